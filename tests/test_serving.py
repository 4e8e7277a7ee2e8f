"""``fv serve`` end to end: a real uvicorn server on 127.0.0.1 (free port), driven with httpx.

The served card is a fixture parameter (``SERVED_CARD``); switch it to ``wan-tiny`` once
fv-wan is installed. Sizes, frame counts and limits are derived from the card's own
defaults so the same tests hold for any card.
"""

from __future__ import annotations

import asyncio
import contextlib
import base64
import io
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from fv_kernel.model.instance import ModelInstance, build_instance  # noqa: E402
from fv_kernel.model.validate import RequestLimits  # noqa: E402
from fv_kernel.extend.interceptors import BlockInterceptor
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.config import DeployConfig, DeployConfigError, ServerConfig  # noqa: E402
from fv_kernel.runtime.engine import Engine  # noqa: E402
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.serving import JobStore, ServerThread, create_app  # noqa: E402
from fv_kernel.testing import read_sse, wait_for_job  # noqa: E402

SERVED_CARD = "toy-dit"
API_KEY = "s3cret-key"


def build_card_instance(card_id: str) -> ModelInstance:
    """Toy cards are built directly; any other id is resolved through the installed plugins."""
    from fv_kernel.testing.toy import toy_card, toy_cards

    if card_id in {c.model_id for c in toy_cards()}:
        return build_instance(toy_card(card_id))
    from fv_kernel.model.catalog import CardCatalog
    from fv_kernel.plugins.host import PluginHost

    return build_instance(CardCatalog(PluginHost()).get(card_id))


@pytest.fixture(params=[SERVED_CARD])
def card_id(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass
class Served:
    server: ServerThread
    engine: Engine
    config: DeployConfig
    card: Any

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, **kwargs: Any) -> "httpx.Client":
        return httpx.Client(base_url=self.url, timeout=60.0, **kwargs)

    def store(self) -> JobStore:
        return JobStore(self.config.server.db_path or Path(self.config.output_dir) / "jobs.sqlite3")


class ToyCacheParams(BaseModel):
    """The per-request schema of the test's enabled block interceptor."""

    model_config = ConfigDict(extra="forbid")
    threshold: float = Field(default=0.1, ge=0, le=1)


class ToyCache(BlockInterceptor):
    """A block interceptor that computes every block (so outputs are unchanged) and counts its calls."""

    plugin_id = "toy-cache"
    request_model = ToyCacheParams

    def distribution_altering(self, params: BaseModel) -> bool:
        return params.threshold > 0  # type: ignore[attr-defined]

    def run_blocks(self, blocks, hidden, state, params, call):  # type: ignore[no-untyped-def]
        state["calls"] = state.get("calls", 0) + 1
        return blocks.run(0, blocks.num_blocks, hidden)


def start_server(card_id: str, output_dir: Path, *, scheduler: SchedulerConfig | None = None, **config: Any) -> Served:
    deploy = DeployConfig(output_dir=output_dir, extensions={"toy-cache": {}}, **config)
    extensions = ExtensionSet.build(deploy.extensions, {"toy-cache": ToyCache})
    engine = Engine(scheduler or SchedulerConfig(), limits=deploy.limits, extensions=extensions)
    instance = build_card_instance(card_id)
    engine.add_instance(instance)
    app = create_app(engine, deploy)
    return Served(ServerThread(app).start(), engine, deploy, instance.card)


@pytest.fixture
def served(card_id: str, tmp_path: Path) -> Iterator[Served]:
    s = start_server(card_id, tmp_path / "out")
    yield s
    s.server.stop()


def sse_events(client: "httpx.Client", job_id: str) -> list[tuple[int, str, dict[str, Any]]]:
    """Read a job's event stream to its end: (id, event, data) triples."""
    with client.stream("GET", f"/v1/videos/{job_id}/events") as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [(event["id"], event["event"], event["data"]) for event in read_sse(response)]
    return events


def png_bytes(width: int = 8, height: int = 8) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


# --------------------------------------------------------------------------- happy path


def test_create_stream_and_content(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    av = pytest.importorskip("av")
    from fv_kernel.serving import jobs
    from fv_kernel.testing import recording_loop_use

    encode, encoded_on_the_loop = recording_loop_use(jobs.preview_png)  # preview PNGs are made on a worker thread
    monkeypatch.setattr(jobs, "preview_png", encode)
    d = served.card.capabilities.defaults
    with served.client() as client:
        created = client.post("/v1/videos", json={"prompt": "a red fox", "seed": 7})
        assert created.status_code == 200, created.text
        job = created.json()
        assert job["object"] == "video" and job["status"] in ("queued", "in_progress") and job["seed"] == 7
        assert job["size"] == f"{d.width}x{d.height}" and job["frames"] == d.frames and job["model"] == served.card.model_id

        events = sse_events(client, job["id"])
        ids = [e[0] for e in events]
        names = [e[1] for e in events]
        assert ids == sorted(set(ids)), "event ids strictly increase"
        assert names[0] == "video.queued" and names[1] == "video.started"
        assert names[-2:] == ["video.artifact", "video.completed"]
        progress = [e[2]["progress"] for e in events if e[1] == "video.progress"]
        denoise_steps = [e[2]["step"] for e in events if e[1] == "video.progress" and e[2]["loop_id"] == "denoise"]
        assert denoise_steps == list(range(1, d.steps + 1)), "one progress event per denoise step, in order"
        assert progress == sorted(progress) and 0 < progress[-1] < 100
        previews = [e[2] for e in events if e[1] == "video.preview"]
        assert previews, "decoded frames are streamed as previews"
        assert base64.b64decode(previews[0]["image"]["b64"]).startswith(b"\x89PNG")
        assert names.index("video.preview") < names.index("video.artifact")
        assert encoded_on_the_loop and not any(encoded_on_the_loop)
        artifact = events[-2][2]
        assert artifact["frames"] == d.frames and artifact["content"]["video"] == f"/v1/videos/{job['id']}/content"
        assert events[-1][2]["status"] == "completed" and events[-1][2]["progress"] == 100

        content = client.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        with av.open(io.BytesIO(content.content)) as container:
            frames = list(container.decode(video=0))
        assert len(frames) == d.frames
        assert (frames[0].width, frames[0].height) == (d.width, d.height)
        thumb = client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
        assert thumb.status_code == 200 and thumb.content.startswith(b"\x89PNG")

        # A late subscriber replays the whole stream from the start.
        assert [e[1] for e in sse_events(client, job["id"])] == names
        listed = client.get("/v1/videos").json()
        assert listed["object"] == "list" and listed["data"][0]["id"] == job["id"] and listed["has_more"] is False
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [served.card.model_id]

        images = client.post("/v1/images/generations", json={"prompt": "a fox", "n": 2, "seed": 3})
        assert images.status_code == 200, images.text
        from PIL import Image

        data = images.json()["data"]
        assert len(data) == 2
        with Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"]))) as image:
            assert image.size == (d.width, d.height)

        metrics = client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        text = metrics.text
        for needle in (
            "fv_queue_depth 0", "fv_running_loops 0", 'fv_work_units_total{kind="diffusion_step"}',
            'fv_step_latency_seconds_bucket{le="+Inf"}', "fv_step_latency_seconds_count", "fv_gpu_seconds_admitted_total",
            "fv_gpu_seconds_refunded_total", 'fv_jobs{status="completed"} 1', "fv_scheduler_seconds_total",
            "fv_loop_host_seconds_total", "fv_execute_seconds_total",
        ):
            assert needle in text, needle

        deleted = client.delete(f"/v1/videos/{job['id']}")
        assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
        assert client.get(f"/v1/videos/{job['id']}").status_code == 404
        assert not (Path(served.config.output_dir) / job["id"]).exists()


def test_seconds_become_a_valid_frame_count(served: Served) -> None:
    caps = served.card.capabilities
    with served.client() as client:
        job = client.post("/v1/videos", json={"prompt": "x", "seconds": 1, "fps": caps.defaults.fps, "steps": 1}).json()
        assert caps.frame_rule.accepts(job["frames"]) and job["frames"] >= caps.defaults.fps
        assert wait_for_job(client, job["id"], {"completed", "failed"})["status"] == "completed"


def test_multipart_create_reads_the_image(served: Served) -> None:
    d = served.card.capabilities.defaults
    with served.client() as client:
        response = client.post(
            "/v1/videos", data={"prompt": "x", "size": f"{d.width}x{d.height}", "steps": "1"},
            files={"input_reference": ("first.png", png_bytes(d.width, d.height), "image/png")},
        )
        if "image_to_video" in served.card.capabilities.tasks:
            assert response.status_code == 200, response.text
            assert response.json()["task"] == "image_to_video"
        else:  # the card cannot animate it: refused before the image is decoded, naming it
            assert response.status_code == 400 and response.json()["error"]["param"] == "input_reference"
        plain = client.post("/v1/videos", data={"prompt": "x", "steps": "1", "extensions": '{"toy-cache": {"threshold": 0.5}}'})
        assert plain.status_code == 200, plain.text
        assert wait_for_job(client, plain.json()["id"], {"completed", "failed"})["status"] == "completed"


# --------------------------------------------------------------------------- cancellation


def test_cancel_mid_run_releases_reservations(served: Served) -> None:
    with served.client() as client:
        slow = client.post("/v1/videos", json={"prompt": "slow", "steps": 5000}).json()
        other = client.post("/v1/videos", json={"prompt": "bystander", "steps": 2}).json()
        seen = []
        with client.stream("GET", f"/v1/videos/{slow['id']}/events") as stream:
            cancelled = False
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    seen.append(line[7:])
                if line.startswith("data: ") and seen[-1] == "video.progress" and not cancelled:
                    if json.loads(line[6:])["loop_id"] == "denoise":
                        reply = client.post(f"/v1/videos/{slow['id']}/cancel")
                        assert reply.status_code == 200 and reply.json()["status"] in ("queued", "in_progress")
                        cancelled = True
        assert seen[-1] == "video.cancelled" and "video.artifact" not in seen
        job = client.get(f"/v1/videos/{slow['id']}").json()
        assert job["status"] == "cancelled" and job["error"]["type"] == "cancelled" and job["progress"] < 100
        assert client.get(f"/v1/videos/{slow['id']}/content").status_code == 404
        # Idempotent cancel of a cancelled job; the bystander is unaffected.
        assert client.post(f"/v1/videos/{slow['id']}/cancel").json()["status"] == "cancelled"
        assert wait_for_job(client, other["id"], {"completed", "failed", "cancelled"})["status"] == "completed"
        assert client.post(f"/v1/videos/{other['id']}/cancel").status_code == 409
    assert served.engine.admission.reservations == {}
    assert served.engine.admission.memory_in_use() == 0
    with contextlib.closing(served.store()) as store:
        assert store.get(slow["id"]).status == "cancelled"


# --------------------------------------------------------------------------- bad input


def bad_input_cases(card: Any) -> list[tuple[str, str, str, dict[str, Any], int, str, str | None]]:
    """(name, method, path, httpx kwargs, status, error type, param), derived from the card and the limits below."""
    caps = card.capabilities
    d = caps.defaults
    m = caps.spatial_multiple
    bad_frames = d.frames + 1 if caps.frame_rule.modulus > 1 else None
    unknown_id = "video_" + "0" * 32
    # A card without image-to-video refuses any image before reading it (tests/test_serving_hardening.py
    # checks undecodable images on a card that takes them).
    image_error = "invalid_image" if "image_to_video" in caps.tasks else "invalid_request"
    cases = [
        ("malformed json", "POST", "/v1/videos", {"content": b'{"prompt": ', "headers": {"content-type": "application/json"}}, 400, "invalid_json", None),
        ("json not an object", "POST", "/v1/videos", {"json": ["prompt"]}, 400, "invalid_json", None),
        ("missing prompt", "POST", "/v1/videos", {"json": {"size": "8x8"}}, 400, "invalid_request", "prompt"),
        ("unknown field", "POST", "/v1/videos", {"json": {"prompt": "x", "bogus": 1}}, 400, "unknown_field", "bogus"),
        ("unknown model", "POST", "/v1/videos", {"json": {"prompt": "x", "model": "nope"}}, 404, "unknown_model", "model"),
        ("size not WxH", "POST", "/v1/videos", {"json": {"prompt": "x", "size": "big"}}, 400, "invalid_request", "size"),
        ("size zero", "POST", "/v1/videos", {"json": {"prompt": "x", "size": "0x8"}}, 400, "invalid_request", "size"),
        ("size off the grid", "POST", "/v1/videos", {"json": {"prompt": "x", "size": f"{d.width + m // 2 or 1}x{d.height}"}}, 400, "invalid_request", "width"),
        ("negative steps", "POST", "/v1/videos", {"json": {"prompt": "x", "steps": -1}}, 400, "invalid_request", "steps"),
        ("frames and seconds", "POST", "/v1/videos", {"json": {"prompt": "x", "frames": d.frames, "seconds": 1}}, 400, "invalid_request", "seconds"),
        ("frames over limit", "POST", "/v1/videos", {"json": {"prompt": "x", "frames": d.frames + 2 * caps.frame_rule.modulus}}, 400, "invalid_request", "frames"),
        ("steps over limit", "POST", "/v1/videos", {"json": {"prompt": "x", "steps": d.steps + 1}}, 400, "invalid_request", "steps"),
        ("pixels over limit", "POST", "/v1/videos", {"json": {"prompt": "x", "size": f"{2 * d.width}x{2 * d.height}"}}, 400, "invalid_request", "size"),
        ("oversized body", "POST", "/v1/videos", {"json": {"prompt": "x" * 70_000}}, 413, "body_too_large", None),
        ("oversized chunked body", "POST", "/v1/videos", {"content": iter([b'{"prompt": "', b"x" * 70_000, b'"}']), "headers": {"content-type": "application/json"}}, 413, "body_too_large", None),
        ("image not base64", "POST", "/v1/videos", {"json": {"prompt": "x", "input_reference": "%%%"}}, 400, image_error, "input_reference"),
        ("image not an image", "POST", "/v1/videos", {"json": {"prompt": "x", "input_reference": base64.b64encode(b"hello, not a png").decode()}}, 400, image_error, "input_reference"),
        ("multipart file not an image", "POST", "/v1/videos", {"data": {"prompt": "x"}, "files": {"input_reference": ("a.png", b"GIF89? no", "image/png")}}, 400, image_error, "input_reference"),
        ("multipart unknown field", "POST", "/v1/videos", {"data": {"prompt": "x", "colour": "red"}}, 400, "unknown_field", "colour"),
        ("multipart unknown file", "POST", "/v1/videos", {"data": {"prompt": "x"}, "files": {"mask": ("m.png", png_bytes(), "image/png")}}, 400, "unknown_field", "mask"),
        ("unsupported content type", "POST", "/v1/videos", {"content": b"prompt=x", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type", None),
        ("extension not enabled", "POST", "/v1/videos", {"json": {"prompt": "x", "extensions": {"cache-dit": {}}}}, 400, "extension_not_enabled", "extensions.cache-dit"),
        ("extension param out of range", "POST", "/v1/videos", {"json": {"prompt": "x", "extensions": {"toy-cache": {"threshold": 5}}}}, 400, "invalid_request", "extensions.toy-cache.threshold"),
        ("extension unknown param", "POST", "/v1/videos", {"json": {"prompt": "x", "extensions": {"toy-cache": {"evil": 1}}}}, 400, "unknown_field", "extensions.toy-cache.evil"),
        ("bad id", "GET", "/v1/videos/not-a-video", {}, 400, "invalid_request", "video_id"),
        ("bad id traversal", "GET", "/v1/videos/..%2F..%2Fetc%2Fpasswd/content", {}, 404, "not_found", None),
        ("bad id dots", "GET", "/v1/videos/..%2Fjobs.sqlite3/content", {}, 404, "not_found", None),
        ("bad id content", "GET", "/v1/videos/jobs.sqlite3/content", {}, 400, "invalid_request", "video_id"),
        ("unknown id", "GET", f"/v1/videos/{unknown_id}", {}, 404, "not_found", "video_id"),
        ("bad id cancel", "POST", "/v1/videos/video_XYZ/cancel", {}, 400, "invalid_request", "video_id"),
        ("unknown id delete", "DELETE", f"/v1/videos/{unknown_id}", {}, 404, "not_found", "video_id"),
        ("bad id events", "GET", "/v1/videos/video_/events", {}, 400, "invalid_request", "video_id"),
        ("bad variant", "GET", f"/v1/videos/{unknown_id}/content", {"params": {"variant": "raw"}}, 400, "invalid_request", "variant"),
        ("bad page limit", "GET", "/v1/videos", {"params": {"limit": 0}}, 400, "invalid_request", "limit"),
        ("bad page cursor", "GET", "/v1/videos", {"params": {"after": "x"}}, 400, "invalid_request", "after"),
        ("bad Last-Event-ID", "GET", f"/v1/videos/{unknown_id}/events", {"headers": {"last-event-id": "x"}}, 404, "not_found", "video_id"),
        ("images n zero", "POST", "/v1/images/generations", {"json": {"prompt": "x", "n": 0}}, 400, "invalid_request", "n"),
        ("images url format", "POST", "/v1/images/generations", {"json": {"prompt": "x", "response_format": "url"}}, 400, "invalid_request", "response_format"),
        ("images unknown field", "POST", "/v1/images/generations", {"json": {"prompt": "x", "style": "vivid"}}, 400, "unknown_field", "style"),
        ("images malformed json", "POST", "/v1/images/generations", {"content": b"{", "headers": {"content-type": "application/json"}}, 400, "invalid_json", None),
        ("unknown route", "GET", "/v1/nothing", {}, 404, "not_found", None),
    ]
    if bad_frames is not None:
        cases.append(("frames off the rule", "POST", "/v1/videos", {"json": {"prompt": "x", "frames": bad_frames}}, 400, "invalid_request", "frames"))
    return cases


def test_bad_input_table(card_id: str, tmp_path: Path) -> None:
    card = build_card_instance(card_id).card
    d = card.capabilities.defaults
    limits = RequestLimits(max_frames=d.frames + card.capabilities.frame_rule.modulus, max_pixels=d.width * d.height, max_steps=d.steps)
    served = start_server(card_id, tmp_path / "out", limits=limits, server=ServerConfig(max_body_bytes=64 * 1024))
    try:
        with served.client() as client:
            bystander = client.post("/v1/videos", json={"prompt": "unaffected", "seed": 1}).json()
            failures = []
            for name, method, path, kwargs, status, error_type, param in bad_input_cases(card):
                response = client.request(method, path, **kwargs)
                body = response.json()
                got = (response.status_code, body.get("error", {}).get("type"), body.get("error", {}).get("param"))
                if got != (status, error_type, param) or set(body["error"]) != {"type", "message", "param", "code"} or body["error"]["code"] != error_type:
                    failures.append(f"{name}: expected {(status, error_type, param)}, got {got}: {body}")
            assert not failures, "\n".join(failures)
            assert wait_for_job(client, bystander["id"], {"completed", "failed", "cancelled"})["status"] == "completed"
            assert client.post("/v1/videos", json={"prompt": "after", "steps": 1}).status_code == 200
            listed = client.get("/v1/videos", params={"limit": 1}).json()
            assert len(listed["data"]) == 1 and listed["has_more"] is True
            page2 = client.get("/v1/videos", params={"limit": 1, "after": listed["last_id"]}).json()
            assert page2["data"][0]["id"] == bystander["id"] and page2["has_more"] is False
            metrics = client.get("/metrics").text
            assert 'fv_rejections_total{reason="body_too_large"} 2' in metrics
            assert 'fv_rejections_total{reason="unknown_field"}' in metrics
    finally:
        served.server.stop()
    with contextlib.closing(served.store()) as store:
        assert store.count() == 2, "no refused request left a job behind"


# --------------------------------------------------------------------------- load


def test_200_requests_from_32_clients(card_id: str, tmp_path: Path) -> None:
    served = start_server(card_id, tmp_path / "out", scheduler=SchedulerConfig(max_running_requests=4, max_queue=8))
    outcomes: list[tuple[str, str]] = []  # ("created", id) | ("429", retry-after)

    async def client_task(client: "httpx.AsyncClient", count: int, worker: int) -> None:
        for i in range(count):
            response = await client.post("/v1/videos", json={"prompt": f"load {worker}-{i}", "steps": 2, "seed": i})
            if response.status_code == 429:
                assert response.json()["error"]["type"] == "queue_full"
                outcomes.append(("429", response.headers["retry-after"]))
                continue
            assert response.status_code == 200, response.text
            job_id = response.json()["id"]
            outcomes.append(("created", job_id))
            async with client.stream("GET", f"/v1/videos/{job_id}/events") as stream:
                last = None
                async for line in stream.aiter_lines():
                    if line.startswith("event: "):
                        last = line[7:]
            assert last == "video.completed", (job_id, last)

    async def run() -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=served.url, timeout=120.0, limits=limits) as client:
            shares = [200 // 32 + (1 if w < 200 % 32 else 0) for w in range(32)]
            await asyncio.gather(*(client_task(client, n, w) for w, n in enumerate(shares)))

    try:
        asyncio.run(run())
        with served.client() as client:
            metrics = client.get("/metrics").text
    finally:
        served.server.stop()
    created = [value for kind, value in outcomes if kind == "created"]
    rejected = [value for kind, value in outcomes if kind == "429"]
    assert len(outcomes) == 200 and len(created) + len(rejected) == 200
    assert len(set(created)) == len(created), "no duplicated job ids"
    assert rejected and all(int(r) >= 1 for r in rejected), "a full queue answers 429 with Retry-After"
    assert f'fv_rejections_total{{reason="queue_full"}} {len(rejected)}' in metrics
    with contextlib.closing(served.store()) as store:
        assert store.count() == len(created) == store.count("completed"), "every accepted job is in the DB, completed"
        assert set(store.ids()) == set(created)
    assert served.engine.admission.reservations == {}


# --------------------------------------------------------------------------- restart


_CRASHABLE_SERVER = """
import sys
from pathlib import Path
from fv_kernel.model.instance import build_instance
from fv_kernel.config import DeployConfig
from fv_kernel.runtime.engine import Engine
from fv_kernel.serving import ServerThread, create_app
from fv_kernel.testing.toy import toy_card

# Request-level scheduling: a second job stays queued behind the first.
config = DeployConfig(output_dir=Path(sys.argv[1]), scheduler={"scheduling": "request"})
engine = Engine(config.scheduler, limits=config.limits)
engine.add_instance(build_instance(toy_card(sys.argv[2])))
server = ServerThread(create_app(engine, config)).start()
print(server.port, flush=True)
server._thread.join()
"""


def test_restart_lists_completed_jobs_and_resumes_interrupted_ones(card_id: str, tmp_path: Path) -> None:
    from fv_kernel.testing.toy import toy_cards

    if card_id not in {c.model_id for c in toy_cards()}:
        pytest.skip("the crash subprocess builds toy cards only")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen(
        [sys.executable, "-c", _CRASHABLE_SERVER, str(out), card_id], stdout=subprocess.PIPE, env=env, text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client:
            done = client.post("/v1/videos", json={"prompt": "kept", "seed": 5}).json()
            assert wait_for_job(client, done["id"], {"completed", "failed"})["status"] == "completed"
            video = client.get(f"/v1/videos/{done['id']}/content").content
            running = client.post("/v1/videos", json={"prompt": "interrupted", "steps": 10_000}).json()
            wait_for_job(client, running["id"], {"in_progress"})
            queued = client.post("/v1/videos", json={"prompt": "never started", "steps": 1}).json()
            assert client.get(f"/v1/videos/{queued['id']}").json()["status"] == "queued"
    finally:
        process.send_signal(signal.SIGKILL)  # a crash: no shutdown hook runs
        process.wait(30)
    served = start_server(card_id, out)
    try:
        with served.client() as client:
            listed = {j["id"]: j for j in client.get("/v1/videos").json()["data"]}
            assert set(listed) == {done["id"], running["id"], queued["id"]}
            assert listed[done["id"]]["status"] == "completed"
            assert client.get(f"/v1/videos/{done['id']}/content").content == video
            # Both unfinished jobs resumed (tests/test_serving_resume.py checks their output bit for bit).
            assert wait_for_job(client, queued["id"], {"completed", "failed"})["status"] == "completed"
            assert client.get(f"/v1/videos/{running['id']}").json()["status"] == "in_progress"
            assert client.post(f"/v1/videos/{running['id']}/cancel").json()["status"] in ("in_progress", "cancelled")
            # A job finished by the earlier process replays its whole stream, stored on disk.
            replay = [e[1] for e in sse_events(client, done["id"])]
            assert replay[:2] == ["video.queued", "video.started"] and "video.progress" in replay
            assert replay[-2:] == ["video.artifact", "video.completed"]
    finally:
        served.server.stop()


# --------------------------------------------------------------------------- auth


def test_api_key_guards_everything_but_health(card_id: str, tmp_path: Path) -> None:
    served = start_server(card_id, tmp_path / "out", api_key=API_KEY)
    try:
        with served.client() as anonymous, served.client(headers={"Authorization": f"Bearer {API_KEY}"}) as authed:
            assert anonymous.get("/health").status_code == 200
            for method, path in (("GET", "/v1/models"), ("GET", "/v1/videos"), ("POST", "/v1/videos"), ("GET", "/metrics"),
                                 ("GET", "/v1/videos/" + "video_" + "0" * 32), ("POST", "/v1/images/generations"),
                                 ("GET", "/openapi.json"), ("GET", "/nowhere")):
                response = anonymous.request(method, path)
                assert response.status_code == 401, (method, path)
                assert response.json()["error"]["type"] == "authentication_error"
                assert response.headers["www-authenticate"] == "Bearer"
            for header in (f"Bearer {API_KEY}x", f"Basic {API_KEY}", API_KEY, "Bearer", f"Bearer {API_KEY[:-1]}"):
                assert anonymous.get("/v1/models", headers={"Authorization": header}).status_code == 401, header
            assert authed.get("/v1/models").status_code == 200
            job = authed.post("/v1/videos", json={"prompt": "x", "steps": 1}).json()
            assert wait_for_job(authed, job["id"], {"completed"})["status"] == "completed"
            assert authed.get(f"/v1/videos/{job['id']}/content").status_code == 200
            assert anonymous.get(f"/v1/videos/{job['id']}/content").status_code == 401
    finally:
        served.server.stop()


# --------------------------------------------------------------------------- CLI config


def test_serve_config_overrides(tmp_path: Path) -> None:
    from fv_kernel.cli.serve_cmd import resolve_serve_config

    path = tmp_path / "deploy.yaml"
    path.write_text("cards: [wan-tiny]\nserver: {port: 9000, max_body_bytes: 1024}\nscheduler: {max_queue: 4}\n")
    config = resolve_serve_config(path, ["toy-dit"], "0.0.0.0", None, "k")
    assert [c.model for c in config.cards] == ["toy-dit"]
    assert (config.server.host, config.server.port, config.server.max_body_bytes) == ("0.0.0.0", 9000, 1024)
    assert config.api_key == "k" and config.scheduler.max_queue == 4
    path.write_text("server: {prot: 1}\n")
    with pytest.raises(DeployConfigError) as err:
        resolve_serve_config(path, [], None, None, None)
    assert err.value.param == "server.prot"
    with pytest.raises(Exception):
        resolve_serve_config(None, [], None, 70000, None)


def test_an_exact_job_is_an_exact_request_and_runs_its_rows_alone(card_id: str, tmp_path: Path) -> None:
    """``exact: true`` on /v1/videos and /v1/images/generations reaches the engine's request: under the
    default throughput batching, the n images of one exact call never share a fused call (without it, they do).
    ``priority`` reaches it too."""
    from fv_kernel.testing import StepRecorder

    served = start_server(card_id, tmp_path)
    recorder = StepRecorder()
    served.engine.observers.append(recorder)
    submitted: dict[str, Any] = {}
    submit = served.engine.submit
    served.engine.submit = lambda request, **kw: submitted.setdefault(request.request_id, request) and submit(request, **kw)  # type: ignore[method-assign]
    try:
        with served.client() as client:
            jobs = [client.post("/v1/videos", json={"prompt": "a red fox", "exact": exact}).json() for exact in (True, False)]
            for job in jobs:
                sse_events(client, job["id"])
            assert [submitted[job["id"]].exact for job in jobs] == [True, False]
            fused_images = {}
            for exact in (True, False):
                recorder.records.clear()
                images = client.post("/v1/images/generations", json={"prompt": "a fox", "n": 2, "exact": exact})
                assert images.status_code == 200, images.text
                fused_images[exact] = any(sum(rec.fused) > 1 for rec in recorder.records)
            assert fused_images == {True: False, False: True}
            bad = client.post("/v1/videos", json={"prompt": "a fox", "exact": "sometimes"})
            assert bad.status_code == 400 and "exact" in bad.text
            background = client.post("/v1/videos", json={"prompt": "a fox", "priority": "batch"}).json()
            sse_events(client, background["id"])
            assert submitted[background["id"]].priority == "batch" and submitted[jobs[0]["id"]].priority == "interactive"
            bad = client.post("/v1/videos", json={"prompt": "a fox", "priority": "urgent"})
            assert bad.status_code == 400 and "priority" in bad.text
    finally:
        served.server.stop()
