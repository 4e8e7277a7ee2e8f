"""The real Dynamo frontend (``python -m dynamo.frontend``) and two fv workers serving wan-tiny, on 127.0.0.1.

Each test starts its own fleet with a fresh discovery store and stops every process it
started by its PID. Dynamo must be installed (the tox env installs it); without it these
tests fail rather than skip, because CI's fv-dynamo env exists to run them.
"""

from __future__ import annotations

import base64
import io
import json
import re
import signal
import threading
import time
from pathlib import Path

import av
import httpx
import pytest

from fv_dynamo.local_fleet import LocalFleet

pytestmark = pytest.mark.timeout(240)

PROMPT = "a red circle moves left"


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text("cards: [wan-tiny]\n")
    return path


@pytest.fixture
def fleet(tmp_path: Path, deploy: Path):
    fleet = LocalFleet(tmp_path / "fleet", deploy, workers=2, extra_env={"OMP_NUM_THREADS": "1"})
    try:
        fleet.start()
        yield fleet
    finally:
        codes = fleet.stop()
        assert all(p.poll() is not None for p in fleet.processes.values()), codes


def _accepted(fleet: LocalFleet, name: str) -> list[str]:
    return re.findall(r"request (\S+) accepted", fleet.log(name))


def _video(extra: dict | None = None, **fields) -> dict:
    body = {"model": "wan-tiny", "prompt": PROMPT, **fields}
    body.update(extra or {})
    return body


def _decode_mp4(data: bytes) -> tuple[int, int, int]:
    with av.open(io.BytesIO(data)) as container:
        frames = [f for f in container.decode(video=0)]
    return len(frames), frames[0].width, frames[0].height


def test_videos_end_to_end_stream_spread_and_refusals(fleet: LocalFleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=120) as client:
        # /v1/videos, non-streaming: one response with the MP4; fv's fields ride in extra_body (passthrough).
        response = client.post("/v1/videos", json=_video(steps=2, seed=7, frames=9, size="96x64"))
        assert response.status_code == 200, response.text
        video = response.json()
        assert video["status"] == "completed" and video["progress"] == 100
        assert video["data"][0]["output_format"] == "mp4"
        frames, width, height = _decode_mp4(base64.b64decode(video["data"][0]["b64_json"]))
        assert (frames, width, height) == (9, 96, 64)

        # Streaming: SSE chunks with rising progress, then the completed video.
        chunks = []
        with client.stream("POST", "/v1/videos", json=_video(steps=4, stream=True)) as stream:
            assert stream.status_code == 200
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        progress = [c["progress"] for c in chunks if c["status"] == "in_progress"]
        assert len(progress) >= 3 and progress == sorted(progress) and progress[-1] < 100
        assert chunks[-1]["status"] == "completed" and chunks[-1]["data"][0]["b64_json"]

        # Load spread: Dynamo's router sends concurrent requests to both workers.
        before = {n: len(_accepted(fleet, n)) for n in ("worker0", "worker1")}
        results: list[int] = []

        def one() -> None:
            results.append(client.post("/v1/videos", json=_video(steps=2)).status_code)

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 6
        spread = {n: len(_accepted(fleet, n)) - before[n] for n in before}
        assert sum(spread.values()) == 6 and min(spread.values()) >= 2, spread

        # Bad input: fv serve's structured body (type, param) inside Dynamo's 400.
        for body, param, kind in (
            (_video(steps=0), "steps", "invalid_request"),
            (_video(size="100x64"), "width", "invalid_request"),
            (_video(frames=8), "frames", "invalid_request"),
            (_video(bogus=1), "bogus", "unknown_field"),
            (_video(extensions={"dbcache": {}}), "extensions.dbcache", "extension_not_enabled"),
        ):
            refused = client.post("/v1/videos", json=body)
            assert refused.status_code == 400, (body, refused.text)
            error = json.loads(refused.json()["message"])["error"]
            assert (error["param"], error["type"]) == (param, kind), error

        # Images (the card has text_to_image): /v1/images/generations, one PNG per n.
        images = client.post("/v1/images/generations", json={"model": "wan-tiny", "prompt": PROMPT, "n": 2, "steps": 2})
        assert images.status_code == 200, images.text
        pngs = [base64.b64decode(d["b64_json"]) for d in images.json()["data"]]
        assert len(pngs) == 2 and all(p.startswith(b"\x89PNG") for p in pngs)

        # Cancellation: the client goes away mid-stream; the worker cancels the fv request.
        # (1000 steps: minutes of work, so it cannot finish before the disconnect reaches the worker.)
        with client.stream("POST", "/v1/videos", json=_video(steps=1000, frames=17, stream=True)) as stream:
            for line in stream.iter_lines():
                if '"in_progress"' in line:
                    break
            stream.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "ended: cancelled" not in fleet.log("worker0") + fleet.log("worker1"):
            time.sleep(0.2)
        logs = fleet.log("worker0") + fleet.log("worker1")
        assert "the frontend stopped the stream; cancelling" in logs and "ended: cancelled" in logs


def test_sigkill_mid_run_fails_one_request_clearly_and_loses_nothing_else(fleet: LocalFleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=120) as client:
        # Two long streaming requests, one per worker (round robin); wait until both run.
        streams: dict[int, list[dict]] = {0: [], 1: []}
        errors: dict[int, str] = {}

        def consume(i: int) -> None:
            try:
                with client.stream("POST", "/v1/videos", json=_video(steps=300, stream=True)) as stream:
                    for line in stream.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            streams[i].append(json.loads(line[6:]))
                        elif line.startswith("event: error") or line.startswith(":"):
                            errors[i] = line
            except httpx.HTTPError as exc:
                errors[i] = repr(exc)

        threads = [threading.Thread(target=consume, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (_accepted(fleet, "worker0") and _accepted(fleet, "worker1")
                                                   and all(any(c["status"] == "in_progress" for c in s) for s in streams.values())):
            time.sleep(0.1)
        assert _accepted(fleet, "worker0") and _accepted(fleet, "worker1"), "each worker should run one request"

        fleet.signal("worker0", signal.SIGKILL)
        for t in threads:
            t.join(120)
        outcomes = sorted(s[-1].get("status", "error") if s else "none" for s in streams.values())
        # The killed worker's request ends with an error event naming the failure; the other one completes.
        assert outcomes == ["completed", "error"], ([s[-1:] for s in streams.values()], errors)
        failed = next(s for s in streams.values() if s[-1].get("status") != "completed")
        assert any(c.get("status") == "in_progress" for c in failed)  # it was killed mid-run
        print("error chunk of the killed worker's request:", failed[-1])
        assert failed[-1].get("error") or failed[-1].get("message"), failed[-1]

        # The stale registration costs at most one request; retrying it once is enough, nothing else is lost.
        statuses = [client.post("/v1/videos", json=_video(steps=2)).status_code for _ in range(4)]
        retried = 0
        for i, code in enumerate(statuses):
            if code != 200:
                retried += 1
                assert code in (500, 502, 503), statuses
                statuses[i] = client.post("/v1/videos", json=_video(steps=2)).status_code
        assert retried <= 1 and statuses == [200] * 4, statuses


def test_sigterm_deregisters_cleanly(fleet: LocalFleet) -> None:
    assert len(fleet.instance_entries("videos")) == 2 and len(fleet.instance_entries("fleet")) == 2
    fleet.signal("worker0", signal.SIGTERM)
    assert fleet.processes["worker0"].wait(30) == 0
    assert len(fleet.instance_entries("videos")) == 1 and len(fleet.instance_entries("images")) == 1
    assert len(fleet.instance_entries("fleet")) == 1
    assert "stop requested; deregistering" in fleet.log("worker0")
    # No stale entry: every request goes to the remaining worker, none fails.
    with httpx.Client(base_url=fleet.url, timeout=120) as client:
        statuses = [client.post("/v1/videos", json=_video(steps=2)).status_code for _ in range(4)]
    assert statuses == [200] * 4
    assert len(_accepted(fleet, "worker1")) == 4


def test_a_realtime_session_through_the_gateway_and_dynamo(tmp_path: Path) -> None:
    """``fv realtime-gateway`` in front of a real ``fv worker`` serving wan-toy-causal, over Dynamo's request
    plane: a vLLM-Omni-style client gets fMP4 chunks, a prompt update is acknowledged, and stop ends it."""
    websockets_sync = pytest.importorskip("websockets.sync.client")
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("cards: [wan-toy-causal]\n")
    fleet = LocalFleet(tmp_path / "fleet", deploy, workers=1, frontend=False, extra_env={"OMP_NUM_THREADS": "1"})
    try:
        fleet.start()
        port = fleet.start_gateway()
        with websockets_sync.connect(f"ws://127.0.0.1:{port}/v1/realtime/video") as ws:
            def until(kind: str) -> dict:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    message = ws.recv(timeout=60)
                    if isinstance(message, str):
                        data = json.loads(message)
                        assert data["type"] != "error", data
                        if data["type"] == kind:
                            return data
                raise AssertionError(f"no {kind}")

            ws.send(json.dumps({"type": "session.start", "prompt": PROMPT, "seed": 1}))  # the card's 64x64 at 8 fps
            sid = until("video.start")["request_id"]
            meta = until("video.chunk_metadata")
            payload = ws.recv(timeout=60)
            assert isinstance(payload, bytes) and len(payload) == meta["byte_length"] and payload[4:8] == b"ftyp"
            ws.send(json.dumps({"type": "session.interaction", "interaction": {"event_id": "e1",
                                                                               "event": {"prompt": "moves right"}}}))
            queued = until("session.interaction.queued")
            assert queued["event_id"] == "e1" and queued["request_id"] == sid
            ws.send(json.dumps({"type": "session.stop"}))
            done = until("session.done")
            assert done["request_id"] == sid and done["stopped"] is True
    finally:
        codes = fleet.stop()
        assert all(p.poll() is not None for p in fleet.processes.values()), codes
