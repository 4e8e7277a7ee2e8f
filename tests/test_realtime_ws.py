"""Realtime serving end to end: a real uvicorn server (free localhost port) over an engine with the
toy causal chunk card, driven by the ``websockets`` client (vLLM-Omni's protocol) and httpx (SSE).
Binary chunks are checked as fragmented MP4 box by box and decoded with PyAV."""

from __future__ import annotations

import base64
import io
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
websockets_sync = pytest.importorskip("websockets.sync.client")
websockets_exceptions = pytest.importorskip("websockets.exceptions")
httpx = pytest.importorskip("httpx")
av = pytest.importorskip("av")

import torch

from fv_kernel.config import DeployConfig
from fv_kernel.model.instance import build_instance
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.serving import (
    ServerThread,
    create_app,
    fmp4,
)
from fv_kernel.testing.serving import RealtimeClient, read_sse
from fv_kernel.testing.chunk_kit import chunk_toy_card

MODEL = "toy-chunk"
FPC = 2  # the toy card's frames per chunk
API_KEY = "rt-key"
FPS = 100  # chunks are paced to playback (2 s lead): a high rate keeps the tests fast


class Served:
    def __init__(self, out: Path, **config: Any) -> None:
        deploy = DeployConfig(output_dir=out, **config)
        self.engine = Engine(SchedulerConfig(), limits=deploy.limits)
        self.engine.add_instance(build_instance(chunk_toy_card(MODEL, frames_per_chunk=FPC)))
        self.server = ServerThread(create_app(self.engine, deploy)).start()
        self.ws_url = f"ws://{self.server.host}:{self.server.port}/v1/realtime/video"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path / "out")
    yield s
    s.server.stop()


def boxes(data: bytes) -> list[bytes]:
    """Top-level ISO-BMFF box types, parsed independently of fv's writer."""
    kinds, offset = [], 0
    while offset < len(data):
        size, kind = struct.unpack(">I4s", data[offset:offset + 8])
        assert size >= 8 and offset + size <= len(data), f"bad box {kind!r} at {offset}"
        kinds.append(kind)
        offset += size
    return kinds


def decode(data: bytes) -> list[tuple[int, Any]]:
    with av.open(io.BytesIO(data)) as container:
        return [(frame.pts, frame.to_ndarray(format="rgb24")) for frame in container.decode(video=0)]


Client = RealtimeClient


def start(client: Client, **fields: Any) -> dict[str, Any]:
    client.send({"type": "session.start", "model": MODEL, "prompt": "a red kite", "format": "m4s", "width": 16,
                 "height": 16, "fps": FPS, "num_inference_steps": 4, "guidance_scale": 1.0, "seed": 3, **fields})
    return client.until("video.start")


def test_lifecycle_chunks_are_fmp4_fragments_that_decode_in_order(served: Served) -> None:
    client = Client(served.ws_url)
    started = start(client, extra_params={"max_chunks": 3, "max_ahead_chunks": 5, "idle_timeout_s": 30})
    session = served.engine.sessions.engine._records[started["request_id"]].session  # what the engine was asked
    assert (session.max_chunks, session.max_ahead_chunks, session.idle_timeout_s, session.seed) == (3, 5, 30, 3)
    assert started["format"] == "m4s" and started["config"]["fps"] == FPS
    assert started["config"]["width"] == 16 and started["config"]["height"] == 16
    assert started["config"]["ignored"] == ["num_inference_steps", "guidance_scale"]
    payloads, metas, messages = [], [], []
    for index in range(3):
        meta, binary = client.chunk(messages)
        metas.append(meta)
        payloads.append(binary)
        assert meta["request_id"] == started["request_id"] and meta["kind"] == "media"
        assert meta["transport_chunk_index"] == index and meta["generation_chunk_index"] == index
        assert meta["num_frames"] == FPC and meta["byte_length"] == len(binary)
        for key in ("started_event_ids", "active_event_ids", "completed_event_ids"):
            assert meta[key] == []
    done = client.until("session.done", messages)
    assert done == {"type": "session.done", "request_id": started["request_id"], "chunks": 3, "stopped": False,
                    "reason": "completed"}
    assert any(m["type"] == "video.status" for m in messages if isinstance(m, dict))
    with pytest.raises(websockets_exceptions.ConnectionClosedOK):  # the server closes after session.done
        client.recv()
    # The first binary is init segment + fragment; the rest are one fragment each.
    assert boxes(payloads[0]) == [b"ftyp", b"moov", b"moof", b"mdat"]
    ftyp = struct.unpack(">I", payloads[0][:4])[0]
    moov = struct.unpack(">I", payloads[0][ftyp:ftyp + 4])[0]
    assert metas[0]["init_byte_length"] == ftyp + moov and metas[1]["init_byte_length"] == 0
    for payload in payloads[1:]:
        assert boxes(payload) == [b"moof", b"mdat"]
    frames = decode(b"".join(payloads))
    assert len(frames) == 3 * FPC
    pts = [p for p, _ in frames]
    assert pts == sorted(pts) and len(set(pts)) == len(pts), f"fragments overlap in time: {pts}"
    assert frames[0][1].shape == (16, 16, 3)
    client.close()


def test_fragments_continue_the_timeline_negative_control(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoded frames match the input and carry increasing timestamps; without re-timing they collide."""
    def chunks() -> list[torch.Tensor]:
        return [torch.full((2, 3, 8, 12), level) for level in (0.1, 0.5, 0.9)]

    writer = fmp4.FragmentedMP4Writer(8)
    frames = decode(b"".join(writer.encode(c).payload for c in chunks()))
    assert len(frames) == 6 and [p for p, _ in frames] == [i * frames[1][0] for i in range(6)] and frames[1][0] > 0
    levels = [float(image.mean()) / 255 for _, image in frames]
    assert levels == pytest.approx([0.1, 0.1, 0.5, 0.5, 0.9, 0.9], abs=0.03)
    assert writer.mime.startswith('video/mp4; codecs="avc1.')

    def not_retimed(self: Any, muxed: bytes, frame_start: int) -> bytes:  # the bug: fragments keep time 0
        return b"".join(muxed[o:o + n] for kind, o, n in fmp4.iter_boxes(muxed) if kind in (b"moof", b"mdat"))

    monkeypatch.setattr(fmp4.FragmentedMP4Writer, "_retime", not_retimed)
    broken = fmp4.FragmentedMP4Writer(8)
    pts = [p for p, _ in decode(b"".join(broken.encode(c).payload for c in chunks()))]
    assert len(pts) != 6 or pts != [i * pts[1] for i in range(6)]


def test_interaction_is_acknowledged_applied_and_tracked_by_event_ids(served: Served) -> None:
    client = Client(served.ws_url)
    started = start(client)
    client.chunk()
    client.send({"type": "session.interaction", "interaction": {"event_id": "e1", "event": {"prompt": "a blue kite"}}})
    seen: list[Any] = []
    queued = client.until("session.interaction.queued", seen)
    assert queued["request_id"] == started["request_id"] and queued["event_id"] == "e1" and queued["version"] == 1
    applied = None
    metas = []
    while applied is None or not metas or metas[-1]["active_event_ids"] != ["e1"] or len(metas) < 2:
        message = client.recv()
        if isinstance(message, dict) and message["type"] == "session.prompt_applied":
            applied = message
        elif isinstance(message, dict) and message["type"] == "video.chunk_metadata":
            metas.append(message)
    assert applied["event_id"] == "e1" and applied["version"] == 1
    first = next(m for m in metas if m["active_event_ids"] == ["e1"])
    assert first["started_event_ids"] == ["e1"] and first["generation_chunk_index"] == applied["chunk_index"]
    later = metas[metas.index(first) + 1:] if first is not metas[-1] else []
    for meta in later:
        assert meta["started_event_ids"] == [] and meta["active_event_ids"] == ["e1"]
    # A second update without an event id gets one from the server; the first one completes.
    client.send({"type": "session.interaction", "interaction": {"event": {"prompt": "a green kite"}}})
    second = client.until("session.interaction.queued")
    assert second["event_id"] and second["event_id"] != "e1" and second["version"] == 2
    while True:
        meta, _ = client.chunk()
        if meta["started_event_ids"]:
            assert meta["started_event_ids"] == [second["event_id"]] and meta["completed_event_ids"] == ["e1"]
            break
    client.send({"type": "session.stop"})
    done = client.until("session.done")
    assert done["stopped"] is True and done["reason"] == "stopped"
    client.close()


def test_ping_and_bad_input_get_typed_errors_and_the_session_lives_on(served: Served) -> None:
    client = Client(served.ws_url)
    client.send({"type": "session.ping"})
    assert client.recv() == {"type": "session.pong", "request_id": None}

    def error_for(message: dict[str, Any] | str) -> dict[str, Any]:
        client.ws.send(message if isinstance(message, str) else json.dumps(message))
        reply = client.until("error")
        assert (reply["message"], reply["code"]) == (reply["error"]["message"], reply["error"]["type"])
        return reply["error"]

    assert error_for({"type": "session.bogus"})["type"] == "unknown_message_type"
    assert error_for("{not json")["type"] == "invalid_json"
    assert error_for({"type": "session.interaction", "interaction": {"event": {"prompt": "x"}}})["type"] == "no_session"
    err = error_for({"type": "session.start", "model": MODEL, "prompt": "p", "format": "mp4"})
    assert err["param"] == "format" and "m4s" in err["message"]
    err = error_for({"type": "session.start", "model": MODEL, "prompt": "p", "width": 8192, "height": 16})
    assert err["type"] == "frame_too_large" and err["param"] == "width"
    err = error_for({"type": "session.start", "model": MODEL, "prompt": "p", "width": 1920, "height": 1920})
    assert err["type"] == "frame_too_large" and "pixels" in err["message"]
    err = error_for({"type": "session.start", "model": "nope", "prompt": "p"})
    assert err["type"] == "unknown_model" and err["param"] == "model"
    err = error_for({"type": "session.start", "model": MODEL, "prompt": "p", "colour": "red"})
    assert err["type"] == "unknown_field" and err["param"] == "colour"

    started = start(client)  # the connection survived every mistake
    client.chunk()
    assert error_for({"type": "session.bogus"})["type"] == "unknown_message_type"
    err = error_for({"type": "session.interaction", "interaction": {"event": {"prompt": "  "}}})
    assert err["param"] == "interaction.event.prompt"
    err = error_for({"type": "session.interaction", "interaction": {"event": {"prompt": "x", "multi_modal_data": {}}}})
    assert err["type"] == "unsupported"
    assert error_for({"type": "session.start", "model": MODEL, "prompt": "again"})["type"] == "session_active"
    client.send({"type": "session.ping"})
    assert client.until("session.pong")["request_id"] == started["request_id"]
    meta, _ = client.chunk()  # still streaming after the errors
    assert meta["request_id"] == started["request_id"]
    # A prompt update after stop is refused, typed; the session still ends cleanly.
    client.send({"type": "session.stop"})
    client.send({"type": "session.interaction", "interaction": {"event": {"prompt": "too late"}}})
    seen: list[Any] = []
    done = client.until("session.done", seen)
    errors = [m["error"] for m in seen if isinstance(m, dict) and m["type"] == "error"]
    assert [e["type"] for e in errors] == ["session_closed"]
    assert done["stopped"] is True
    client.close()


def test_num_frames_ends_the_stream_with_exactly_that_many_frames(served: Served) -> None:
    client = Client(served.ws_url)
    start(client, num_frames=5)
    payloads = []
    seen: list[Any] = []
    done = None
    while done is None:
        message = client.recv()
        if isinstance(message, bytes):
            payloads.append(message)
        elif message["type"] == "session.done":
            done = message
        else:
            seen.append(message)
    counts = [m["num_frames"] for m in seen if m["type"] == "video.chunk_metadata"]
    assert counts == [2, 2, 1] and done["chunks"] == 3 and done["stopped"] is False
    assert len(decode(b"".join(payloads))) == 5
    client.close()


def test_websocket_needs_the_api_key_when_one_is_set(tmp_path: Path) -> None:
    s = Served(tmp_path / "out", api_key=API_KEY)
    try:
        with pytest.raises(Exception) as refused:
            Client(s.ws_url).recv()
        assert "403" in str(refused.value) or "1008" in str(refused.value)
        client = Client(s.ws_url, additional_headers={"Authorization": f"Bearer {API_KEY}"})
        client.send({"type": "session.ping"})
        assert client.recv()["type"] == "session.pong"
        client.close()
        client = Client(f"{s.ws_url}?api_key={API_KEY}")
        client.send({"type": "session.ping"})
        assert client.recv()["type"] == "session.pong"
        client.close()
        page = httpx.get(f"http://{s.server.host}:{s.server.port}/realtime")
        assert page.status_code == 200 and "realtime.js" in page.text  # the page itself is open
        doc = httpx.get(f"{s.server.url}/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        assert not [p for p in doc["paths"] if "realtime" in p]  # docs/realtime.md is their reference
    finally:
        s.server.stop()


def test_sse_fallback_streams_the_same_session(served: Served) -> None:
    base = f"http://{served.server.host}:{served.server.port}"
    with httpx.Client(base_url=base, timeout=30) as http:
        bad = http.post("/v1/realtime/video/sessions", json={"model": MODEL, "prompt": "p", "width": 99999})
        assert bad.status_code == 413 and bad.json()["error"]["type"] == "frame_too_large"
        created = http.post("/v1/realtime/video/sessions",
                            json={"model": MODEL, "prompt": "a kite", "width": 16, "height": 16, "fps": FPS})
        assert created.status_code == 201, created.text
        urls = created.json()
        payloads, kinds = [], []
        with http.stream("GET", urls["events_url"]) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            second = http.get(urls["events_url"])
            assert second.status_code == 409
            for event in read_sse(response):
                kinds.append(event["event"])
                data = event["data"]
                if event["event"] == "video.chunk":
                    payload = base64.b64decode(data["data"])
                    assert len(payload) == data["byte_length"]
                    payloads.append(payload)
                    if len(payloads) == 1:
                        ack = http.post(urls["interaction_url"],
                                        json={"interaction": {"event_id": "s1", "event": {"prompt": "a blue kite"}}})
                        assert ack.status_code == 202 and ack.json()["event_id"] == "s1"
                        pong = http.post(urls["ping_url"])
                        assert pong.json()["type"] == "session.pong"
                    if data["active_event_ids"] == ["s1"] and "stop" not in kinds:
                        kinds.append("stop")
                        assert http.post(urls["stop_url"]).status_code == 202
                        late = http.post(urls["interaction_url"], json={"interaction": {"event": {"prompt": "late"}}})
                        assert late.status_code == 409 and late.json()["error"]["type"] == "session_closed"
                if event["event"] == "session.done":
                    assert data["stopped"] is True
                    break
        assert kinds[0] == "video.start" and "session.prompt_applied" in kinds and "stop" in kinds
        assert boxes(payloads[0])[:2] == [b"ftyp", b"moov"]
        assert len(decode(b"".join(payloads))) == FPC * len(payloads)
        gone = http.post(urls["stop_url"])  # an ended session is remembered: a typed 409, not a 404
        assert gone.status_code == 409 and gone.json()["error"]["type"] == "session_closed"
        assert http.post("/v1/realtime/video/sessions/nope/stop").status_code == 404


def test_chunks_are_paced_to_playback_with_a_bounded_lead(served: Served) -> None:
    """At 8 fps a 2-frame chunk is 0.25 s of video: after the 2 s lead, chunks come no faster than that."""
    import time

    client = Client(served.ws_url)
    start(client, fps=8, extra_params={"max_chunks": 12})
    arrivals = []
    for _ in range(12):
        meta, _ = client.chunk()
        arrivals.append((time.monotonic(), meta["transport_chunk_index"]))
    t0 = arrivals[0][0]
    for at, index in arrivals:
        playback = index * FPC / 8
        assert at - t0 >= playback - 2.0 - 0.05, f"chunk {index} sent {playback - (at - t0):.2f}s ahead of playback"
    assert arrivals[-1][0] - t0 >= 11 * 0.25 - 2.0 - 0.05
    status = client.until("video.status")
    assert status["generation_fps"] is None or status["generation_fps"] > 0
    client.close()


def test_a_client_reading_chunks_keeps_the_session_alive(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle timeout 0.6 s, no client message for ~1.5 s: delivered chunks count as presence."""
    import time

    from fv_kernel.serving import realtime

    def read_for(seconds: float) -> dict[str, Any] | None:
        client = Client(served.ws_url)
        start(client, fps=8, extra_params={"idle_timeout_s": 0.6})
        deadline = time.monotonic() + seconds
        ended = None
        while time.monotonic() < deadline and ended is None:
            message = client.recv()
            if isinstance(message, dict) and message["type"] == "session.done":
                ended = message
        client.close()
        return ended

    assert read_for(1.5) is None
    # Negative control: without the keep-alive on delivery, the session idles out while being watched.
    monkeypatch.setattr(realtime.RealtimeSession, "ping", lambda self: None)
    ended = read_for(3.0)
    assert ended is not None and ended["reason"] == "idle_timeout"


def test_a_disconnect_ends_the_session_and_a_failure_is_reported(served: Served) -> None:
    import time

    client = Client(served.ws_url)
    start(client)
    client.chunk()
    assert served.engine.running_count() + served.engine.queue_depth() == 1
    client.close()
    deadline = time.monotonic() + 10
    while served.engine.running_count() + served.engine.queue_depth() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.engine.running_count() + served.engine.queue_depth() == 0, "the session outlived its client"

    client = Client(served.ws_url)  # the toy card's text encoder raises on "boom"
    client.send({"type": "session.start", "model": MODEL, "prompt": "boom", "width": 16, "height": 16, "fps": FPS})
    seen: list[Any] = []
    done = client.until("session.done", seen)
    errors = [m for m in seen if isinstance(m, dict) and m["type"] == "error"]
    assert len(errors) == 1 and errors[0]["error"]["message"]
    assert done["reason"] == "failed" and done["stopped"] is False
    client.close()


def test_sse_heartbeats_reader_leaving_and_forgetting_ended_sessions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from fv_kernel.serving import realtime

    s = Served(tmp_path / "out", server={"sse_heartbeat_s": 0.05})
    try:
        with httpx.Client(base_url=s.server.url, timeout=30) as http:
            urls = http.post("/v1/realtime/video/sessions", json={"model": MODEL, "prompt": "a kite", "width": 16,
                                                                   "height": 16, "fps": 8}).json()
            comments = chunks = 0
            with http.stream("GET", urls["events_url"]) as response:
                deadline = time.monotonic() + 2.8  # past the 2 s lead, chunks come 0.25 s apart
                for line in response.iter_lines():
                    comments += line.startswith(": keep-alive")
                    chunks += line == "event: video.chunk"
                    if time.monotonic() > deadline:
                        break
            assert chunks >= 3 and comments >= 1
            deadline = time.monotonic() + 10  # the reader left: the session ends
            while s.engine.running_count() + s.engine.queue_depth() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s.engine.running_count() + s.engine.queue_depth() == 0
            assert http.post(urls["stop_url"]).status_code == 409
            monkeypatch.setattr(realtime, "_SSE_RETAIN_S", 0.0)
            http.post("/v1/realtime/video/sessions", json={"model": MODEL, "prompt": "another", "fps": FPS})
            assert http.post(urls["stop_url"]).status_code == 404  # forgotten once the retention passed
    finally:
        s.server.stop()


def test_a_chunk_survives_the_text_transport_round_trip() -> None:
    """``chunk_from_json`` undoes ``chunk_as_json`` (what a gateway relaying a worker's chunks relies on)."""
    from fv_kernel.api import chunk_as_json, chunk_from_json

    meta = {"type": "video.chunk_metadata", "request_id": "s1", "transport_chunk_index": 3, "byte_length": 5}
    payload = bytes(range(250, 255))
    wire = chunk_as_json(meta, payload)
    assert wire["type"] == "video.chunk" and isinstance(wire["data"], str)
    assert chunk_from_json(wire) == (meta, payload)
