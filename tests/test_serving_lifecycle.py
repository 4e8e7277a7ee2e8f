"""`fv serve` under disconnects, restarts and load: real uvicorn servers, real sockets, real signals.

- a synchronous ``/v1/images/generations`` call whose client hangs up is cancelled at a step
  boundary and releases its reservations;
- SIGTERM ends attached SSE streams with ``server.shutdown`` and the process exits promptly;
- one server per data dir (an exclusive ``flock``), released by ``kill -9``;
- finished jobs live on disk: the engine and the job manager keep no tensors of them, a
  DELETE frees everything, and a late subscriber replays the whole stream from disk.

Each guarantee has a negative control: the same scenario with the mechanism switched off
fails the assertion that guards it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fv_kernel.model.instance import ModelInstance, build_instance  # noqa: E402
from fv_kernel.config import DeployConfig  # noqa: E402
from fv_kernel.runtime.engine import Engine, run_serially
from fv_kernel.runtime.records import RequestHandle, held_tensor_bytes
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.serving import JobStore, ServerThread, create_app  # noqa: E402
from fv_kernel.serving.jobs import SHUTDOWN_EVENT, JobManager  # noqa: E402
from fv_kernel.serving.store import DataDirInUse, DataDirLock  # noqa: E402
from fv_kernel.testing import read_sse, wait_for_job  # noqa: E402
from fv_kernel.testing.toy import toy_card  # noqa: E402

CARD = "toy-dit"
REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
FINISHED = {"completed", "failed", "cancelled"}


def slowed(instance: ModelInstance, seconds: float) -> ModelInstance:
    """Every step of ``instance`` takes at least ``seconds`` (so "within a few steps" is measurable on any machine)."""
    original = instance.op

    def op(name: str) -> Any:
        step = original(name)
        inner = step.fn

        def fn(inputs: Any, params: Any) -> Any:
            time.sleep(seconds)
            return inner(inputs, params)

        return replace(step, fn=fn)

    instance.op = op  # type: ignore[method-assign]
    return instance


@contextlib.contextmanager
def serving(output_dir: Path, *instances: ModelInstance, **server: Any) -> Iterator[tuple[ServerThread, Engine, Any]]:
    config = DeployConfig(output_dir=output_dir, server=server)
    engine = Engine(SchedulerConfig(), limits=config.limits)
    for instance in instances or (build_instance(toy_card(CARD)),):
        engine.add_instance(instance)
    app = create_app(engine, config)
    server_thread = ServerThread(app).start()
    try:
        yield server_thread, engine, app
    finally:
        server_thread.stop()


def whole_stream(client: "httpx.Client", job_id: str) -> list[dict[str, Any]]:
    with client.stream("GET", f"/v1/videos/{job_id}/events") as response:
        assert response.status_code == 200
        return list(read_sse(response))


# --------------------------------------------------------------------------- disconnects


def _running_image(engine: Engine, timeout_s: float = 60.0) -> RequestHandle:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for request_id in list(engine.scheduler.running):
            if request_id.startswith("image_"):
                handle = engine.handle(request_id)
                if handle.progress > 0:
                    return handle
        time.sleep(0.01)
    raise AssertionError("the images call never started stepping")


@contextlib.contextmanager
def disconnect_mid_run(tmp_path: Path) -> Iterator[tuple[ServerThread, Engine, RequestHandle, float, str]]:
    """A server with a video job queued, and a 5,000-step image over a raw socket whose client hangs up
    mid-denoise: (server, engine, the image's handle, the hang-up time, the video job's id)."""
    instance = slowed(build_instance(toy_card(CARD)), 0.05)
    with serving(tmp_path / "out", instance) as (server, engine, _):
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            bystander = client.post("/v1/videos", json={"prompt": "bystander", "steps": 3}).json()["id"]
        body = json.dumps({"prompt": "a lighthouse", "steps": 5000}).encode()
        sock = socket.create_connection((server.host, server.port))
        sock.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        handle = _running_image(engine)
        sock.close()  # the client goes away mid-run
        try:
            yield server, engine, handle, time.time(), bystander
        finally:
            handle.cancel("test over")


def _wait_finished(handle: RequestHandle, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if handle.status in FINISHED:
            return True
        time.sleep(0.01)
    return False


def _wait_forgotten(engine: Engine, request_id: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            engine.handle(request_id)
        except KeyError:
            return True
        time.sleep(0.01)
    return False


def test_a_disconnected_images_call_is_cancelled_within_a_few_steps_and_releases_its_reservations(tmp_path: Path) -> None:
    with disconnect_mid_run(tmp_path) as (server, engine, handle, hung_up_at, bystander):
        assert _wait_finished(handle, timeout_s=10.0), f"still {handle.status} 10 s after the client hung up"
        assert handle.status == "cancelled"
        ran_after = [e for e in handle._record.events if e.type == "progress" and e.ts > hung_up_at]
        assert len(ran_after) <= 10, f"{len(ran_after)} steps ran after the client hung up"  # 0.1 s polls, 0.05 s steps
        # Forgotten: the engine keeps none of its tensors. The status is set before the request's
        # teardown runs on the engine's thread, so the record may outlive it by a moment.
        assert _wait_forgotten(engine, handle.request_id, timeout_s=5.0), "the engine still holds the cancelled request"
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            assert wait_for_job(client, bystander, FINISHED)["status"] == "completed", "the other job is unaffected"
        assert engine.admission.reservations == {} and engine.admission.memory_in_use() == 0


def test_without_disconnect_polling_the_call_keeps_computing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the poll switched off, the same hang-up leaves the image running."""
    original = JobManager.generate_images

    async def deaf(self: JobManager, body: Any, **kwargs: Any) -> Any:
        return await original(self, body)

    monkeypatch.setattr(JobManager, "generate_images", deaf)
    with disconnect_mid_run(tmp_path) as (_, engine, handle, _, _):
        assert not _wait_finished(handle, timeout_s=2.0), "cancelled without the poll: the test above proves nothing"
        assert handle.request_id in engine.admission.reservations, "its reservation is still held"


# --------------------------------------------------------------------------- SIGTERM


_SERVER_PROCESS = """
import socket, sys
from pathlib import Path
from fv_kernel.model.instance import build_instance
from fv_kernel.config import DeployConfig
from fv_kernel.runtime.engine import Engine
from fv_kernel.serving import create_app, serve_forever
from fv_kernel.testing.toy import toy_card

out, mode = Path(sys.argv[1]), sys.argv[2]
config = DeployConfig(output_dir=out, server={"shutdown_timeout_s": 5})
engine = Engine(config.scheduler, limits=config.limits)
engine.add_instance(build_instance(toy_card("toy-dit")))
app = create_app(engine, config)
if mode == "no-drain":
    app.state.drain = None  # negative control: plain uvicorn shutdown
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
serve_forever(app, host="127.0.0.1", port=0, log_level="warning", shutdown_timeout_s=5, sockets=[sock])
"""


@contextlib.contextmanager
def server_process(output_dir: Path, mode: str = "drain") -> Iterator[tuple[subprocess.Popen[str], "httpx.Client"]]:
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVER_PROCESS, str(output_dir), mode], stdout=subprocess.PIPE, env=ENV, text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/health").status_code == 200:
                        break
                assert time.monotonic() < deadline, "the server never answered /health"
                time.sleep(0.05)
            yield process, client
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def _sigterm_with_a_stream_attached(tmp_path: Path, mode: str) -> tuple[list[dict[str, Any]], float, int, str]:
    """Follow a long job's events, SIGTERM the server mid-denoise: the events after the signal, the
    seconds until the process exited, its exit code, and the job id."""
    with server_process(tmp_path / "out", mode) as (process, client):
        job = client.post("/v1/videos", json={"prompt": "long", "steps": 5000}).json()
        after: list[dict[str, Any]] = []
        signalled_at = None
        with client.stream("GET", f"/v1/videos/{job['id']}/events") as response:
            try:
                for event in read_sse(response):
                    if signalled_at is not None:
                        after.append(event)
                    elif event["event"] == "video.progress" and event["data"]["loop_id"] == "denoise":
                        process.send_signal(signal.SIGTERM)
                        signalled_at = time.monotonic()
            except httpx.TransportError:  # the server dropped the connection without ending the stream
                after.append({"id": None, "event": "<connection dropped>", "data": {}})
        assert signalled_at is not None
        code = process.wait(60)
        return after, time.monotonic() - signalled_at, code, job["id"]


SHUTDOWN_BOUND_S = 5.0


def test_sigterm_ends_attached_streams_with_server_shutdown_and_exits_promptly(tmp_path: Path) -> None:
    after, exit_s, code, job_id = _sigterm_with_a_stream_attached(tmp_path, "drain")
    assert after, "the stream ended with no event after the signal"
    last = after[-1]
    assert last["event"] == SHUTDOWN_EVENT and last["id"] is None, after[-3:]
    assert last["data"]["id"] == job_id and last["data"]["status"] == "in_progress" and "resumes" in last["data"]["message"]
    # uvicorn re-raises the signal once it has shut down: the conventional "terminated by SIGTERM" status.
    assert code in (0, -signal.SIGTERM) and exit_s < SHUTDOWN_BOUND_S, f"exit {code} after {exit_s:.1f} s"
    # Suspended, not cancelled: the next server on the data dir resumes it.
    with contextlib.closing(JobStore(tmp_path / "out" / "jobs.sqlite3")) as store:
        assert store.get(job_id).status == "in_progress"
    assert (tmp_path / "out" / "checkpoints" / f"{job_id}.pt").is_file()


def test_without_the_drain_streams_get_no_terminal_event(tmp_path: Path) -> None:
    """Negative control: uvicorn's own shutdown waits out its timeout and cuts the stream with no terminal event."""
    after, exit_s, _, _ = _sigterm_with_a_stream_attached(tmp_path, "no-drain")
    assert SHUTDOWN_EVENT not in [e["event"] for e in after]
    assert exit_s >= SHUTDOWN_BOUND_S, "uvicorn waits for the open stream until shutdown_timeout_s"


# --------------------------------------------------------------------------- one server per data dir


def test_a_second_server_on_the_same_data_dir_refuses_to_start_and_the_first_keeps_its_jobs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = tmp_path / "deploy.yaml"
    config.write_text(f"output_dir: {out}\nserver:\n  port: 0\n")
    with server_process(out) as (first, client):
        job = client.post("/v1/videos", json={"prompt": "the first server's job", "steps": 40}).json()
        wait_for_job(client, job["id"], {"in_progress"})
        second = subprocess.run(
            [sys.executable, "-m", "fv_kernel.cli.app", "serve", "--config", str(config), "--model", CARD],
            capture_output=True, text=True, env=ENV, timeout=300,
        )
        assert second.returncode == 1
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr  # one line, before any model loads (no "fv serve: ... on http" line)
        assert lines[0].startswith("error: the data dir ") and str(out.resolve()) in lines[0], lines[0]
        assert f"pid {first.pid}" in lines[0], lines[0]
        assert wait_for_job(client, job["id"], FINISHED)["status"] == "completed", "the first server's job is untouched"
        interrupted = client.post("/v1/videos", json={"prompt": "interrupted", "steps": 5000}).json()
        wait_for_job(client, interrupted["id"], {"in_progress"})
        first.send_signal(signal.SIGKILL)  # no shutdown hook: the lock file stays, the flock dies with the process
        first.wait(30)
    assert (out / DataDirLock.FILE_NAME).is_file()
    with serving(out) as (server, _, app):
        assert interrupted["id"] in app.state.manager._live, "the new server took the dir over and resumed the job"
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            assert client.get(f"/v1/videos/{job['id']}").json()["status"] == "completed"
            client.post(f"/v1/videos/{interrupted['id']}/cancel")


def test_without_the_lock_a_second_server_takes_over_the_first_servers_live_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control: the lock is what stops a second server from resuming (rewriting) a live job."""
    out = tmp_path / "out"
    with serving(out) as (server, _, _):
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            live = client.post("/v1/videos", json={"prompt": "live", "steps": 5000}).json()
            wait_for_job(client, live["id"], {"in_progress"})
        with pytest.raises(DataDirInUse, match=rf"{out.resolve()}.*pid {os.getpid()}"):
            with serving(out):
                pass
        monkeypatch.setattr(DataDirLock, "acquire", lambda self: self)
        with serving(out) as (_, _, second):
            assert live["id"] in second.state.manager._live, "unlocked, the second server resumed the first's live job"
            second.state.manager.cancel(live["id"])
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            client.post(f"/v1/videos/{live['id']}/cancel")


# --------------------------------------------------------------------------- memory: finished jobs live on disk


def assert_holds_no_finished_tensors(engine: Engine, manager: JobManager) -> None:
    records, tensor_bytes = engine.retained()
    assert (records, tensor_bytes) == (0, 0), f"the engine keeps {records} finished requests ({tensor_bytes} tensor bytes)"
    assert not manager._runs, "program runs (latents) of finished jobs are kept"
    assert all(job.handle is None for job in manager._live.values() if job.done.is_set()), "a finished job keeps its handle"


def _run_jobs(client: "httpx.Client", count: int) -> list[str]:
    ids = [client.post("/v1/videos", json={"prompt": f"job {i}", "steps": 1}).json()["id"] for i in range(count)]
    for job_id in ids:
        assert wait_for_job(client, job_id, FINISHED)["status"] == "completed"
    return ids


def test_finished_jobs_live_on_disk_and_delete_frees_everything(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with serving(out, finished_history_bytes=0) as (server, engine, app):
        manager, store = app.state.manager, app.state.store
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            ids = _run_jobs(client, 4)
            image = client.post("/v1/images/generations", json={"prompt": "one image", "steps": 1})
            assert image.status_code == 200
            assert_holds_no_finished_tensors(engine, manager)
            assert manager.retained() == (0, 0), "finished_history_bytes=0: no history stays in memory"
            for job_id in ids:  # ... yet every stream replays whole, from disk
                names = [e["event"] for e in whole_stream(client, job_id)]
                assert names[0] == "video.queued" and names[-2:] == ["video.artifact", "video.completed"]
            assert store.event_count() > 0 and all((out / job_id / "video.mp4").is_file() for job_id in ids)
            for job_id in ids:
                assert client.delete(f"/v1/videos/{job_id}").status_code == 200
        assert store.count() == 0 and store.event_count() == 0, "DELETE leaves rows or events"
        assert not any((out / job_id).exists() for job_id in ids), "DELETE leaves files"
        assert not manager._live and not list((out / "checkpoints").iterdir())
        assert_holds_no_finished_tensors(engine, manager)


def test_the_in_memory_history_is_bounded_in_bytes(tmp_path: Path) -> None:
    bound = 6_000
    with serving(tmp_path / "out", finished_history_bytes=bound) as (server, _, app):
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            _run_jobs(client, 5)
        jobs, held = app.state.manager.retained()
        assert 0 < held <= bound and jobs < 5, (jobs, held)


def test_without_forget_the_engine_keeps_every_finished_jobs_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the check above catches an engine that keeps finished requests' tensors (the leak)."""
    monkeypatch.setattr(Engine, "forget", lambda self, request_id: False)
    with serving(tmp_path / "out") as (server, engine, app):
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            ids = _run_jobs(client, 2)
            for job_id in ids:
                client.delete(f"/v1/videos/{job_id}")
        assert engine.retained()[0] == 2 and engine.retained()[1] > 0
        with pytest.raises(AssertionError, match="the engine keeps 2 finished requests"):
            assert_holds_no_finished_tensors(engine, app.state.manager)


def test_the_engine_bounds_finished_records_in_tensor_bytes() -> None:
    from fv_kernel.request.request import DiffusionParams, Request, TextPart
    from fv_kernel.request.types import TaskType
    from fv_kernel.testing.fake_pool import fake_card

    def requests() -> list[Request]:
        return [
            Request(request_id=f"r{i}", model="fake-video", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                    diffusion=DiffusionParams(steps=1, width=64, height=64))
            for i in range(6)
        ]

    def engine(keep_bytes: int) -> Engine:
        e = Engine(SchedulerConfig(device_thread=False, keep_finished_bytes=keep_bytes))
        e.add_instance(build_instance(fake_card()))
        return e

    unbounded = engine(2**40)
    assert all(r.status == "completed" for r in run_serially(unbounded, requests()))
    count, total = unbounded.retained()
    held = [held_tensor_bytes(record.request, record.events) for record in unbounded._records.values()]
    assert count == 6 and total == sum(held) and min(held) > 0, "without a byte bound every record stays"
    bound = total // 2
    bounded = engine(bound)
    results = run_serially(bounded, requests())  # finishing in order r0 ... r5
    assert all(r.status == "completed" and r.artifacts for r in results), "callers keep their results"
    count, kept = bounded.retained()
    assert 0 < count < 6 and 0 < kept <= bound, (count, kept, bound)
    assert set(bounded._records) == {f"r{i}" for i in range(6 - count, 6)}, "the oldest are forgotten first"
    newest = held_tensor_bytes(bounded._records["r5"].request, bounded._records["r5"].events)
    assert bounded.forget("r5") and not bounded.forget("r5") and bounded.retained() == (count - 1, kept - newest)


# --------------------------------------------------------------------------- event history


def test_a_job_that_ended_40_jobs_ago_replays_its_whole_stream_from_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fv_kernel.testing.fake_pool import fake_card

    instances = (build_instance(toy_card(CARD)), build_instance(fake_card(step_seconds=0.0)))
    # 40 later jobs of about 0.5 KiB each overflow an 8 KiB bound (the default is 16 MiB).
    with serving(tmp_path / "out", *instances, finished_history_bytes=8 * 1024) as (server, _, app):
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            first = client.post("/v1/videos", json={"model": CARD, "prompt": "first", "steps": 3}).json()
            live = whole_stream(client, first["id"])  # followed from the start, live
            assert [e["event"] for e in live][-1] == "video.completed"
            later = [client.post("/v1/videos", json={"model": "fake-video", "prompt": f"{i}", "steps": 1}).json()["id"]
                     for i in range(40)]
            for job_id in later:
                wait_for_job(client, job_id, FINISHED)
            assert first["id"] not in app.state.manager._live, "evicted from memory by the byte bound"
            assert whole_stream(client, first["id"]) == live, "the whole stream, as a live subscriber saw it"
            with client.stream("GET", f"/v1/videos/{first['id']}/events", headers={"Last-Event-ID": "2"}) as response:
                assert [e["id"] for e in read_sse(response)] == [e["id"] for e in live if e["id"] > 2]
            # Negative control: without the stored stream, a late subscriber gets only the tail.
            monkeypatch.setattr(JobStore, "events", lambda self, job_id, after=-1: [])
            tail = whole_stream(client, first["id"])
            assert tail != live and [e["event"] for e in tail] == ["video.artifact", "video.completed"]
