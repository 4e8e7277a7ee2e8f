"""``fv realtime-gateway``: vLLM-Omni's realtime WebSocket in front of fv workers.

A real uvicorn server (``fv_kernel.serving.ServerThread``) runs the gateway app; behind it, two real
FvWorkers (each its own engine with the toy causal chunk card) sit behind the stand-in for Dynamo's
endpoint client; the client is the ``websockets`` library, speaking the protocol as a vLLM-Omni client
does (JSON text messages, a binary fMP4 frame after each ``video.chunk_metadata``).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

websockets_sync = pytest.importorskip("websockets.sync.client")
websockets_exceptions = pytest.importorskip("websockets.exceptions")

from fake_dynamo import FakeEndpointClient  # noqa: E402
from fv_dynamo.gateway import WS_PATH, create_gateway  # noqa: E402
from fv_dynamo.sessions import SessionRouter  # noqa: E402
from fv_dynamo.worker import FvWorker, WorkerOptions  # noqa: E402
from fv_kernel.api import Engine, SchedulerConfig, build_instance  # noqa: E402
from fv_kernel.serving import ServerThread  # noqa: E402
from fv_kernel.testing.chunk_kit import chunk_toy_card  # noqa: E402
from fv_kernel.testing.serving import RealtimeClient  # noqa: E402

FPS = 100  # chunks are paced to playback: a high rate keeps the tests fast
API_KEY = "gw-key"


class Gateway:
    """The gateway app on a real server, its router over two in-process workers."""

    def __init__(self, api_key: str | None = None) -> None:
        self.client: FakeEndpointClient | None = None

        @asynccontextmanager
        async def router() -> AsyncIterator[SessionRouter]:
            engines = {}
            for i in (1, 2):
                engines[i] = Engine(SchedulerConfig())
                engines[i].add_instance(build_instance(chunk_toy_card("toy-chunk")))
            async with engines[1].running(), engines[2].running():
                self.client = FakeEndpointClient({i: FvWorker(e, WorkerOptions()) for i, e in engines.items()})
                yield SessionRouter(self.client)

        self.server = ServerThread(create_gateway(router, api_key=api_key)).start()
        self.url = f"ws://{self.server.host}:{self.server.port}{WS_PATH}"

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    g = Gateway()
    yield g
    g.stop()


Client = RealtimeClient


def _start(client: Client, prompt: str = "a red kite") -> dict[str, Any]:
    client.send({"type": "session.start", "prompt": prompt, "width": 16, "height": 16, "fps": FPS, "seed": 3})
    return client.until("video.start")


def _streaming(gateway: Gateway) -> tuple[Client, str, int]:
    """A client whose session has sent its first chunk; the session id and the worker it was placed on."""
    client = Client(gateway.url)
    sid = _start(client)["request_id"]
    client.chunk()
    assert gateway.client is not None
    placed = next(i for i, kind, _ in gateway.client.calls if kind == "session.start")
    return client, sid, placed


def _box_types(data: bytes) -> list[bytes]:
    kinds, offset = [], 0
    while offset < len(data):
        size, kind = struct.unpack(">I4s", data[offset:offset + 8])
        assert size >= 8 and offset + size <= len(data)
        kinds.append(kind)
        offset += size
    return kinds


def test_a_session_streams_through_the_gateway_and_is_steered_on_its_worker(gateway: Gateway) -> None:
    client = Client(gateway.url)
    started = _start(client)
    sid = started["request_id"]
    first, payload = client.chunk()
    assert first["request_id"] == sid and first["byte_length"] == len(payload)
    assert _box_types(payload) == [b"ftyp", b"moov", b"moof", b"mdat"]  # init segment + the first fragment
    assert "data" not in first  # the worker's base64 became the binary frame
    second, payload = client.chunk()
    assert second["transport_chunk_index"] == 1 and _box_types(payload) == [b"moof", b"mdat"]

    client.send({"type": "session.interaction", "interaction": {"event_id": "e1", "event": {"prompt": "a blue kite"}}})
    queued = client.until("session.interaction.queued")
    assert queued["event_id"] == "e1" and queued["request_id"] == sid
    client.chunk(active_event_ids=["e1"])
    assert gateway.client is not None
    placed = next(i for i, kind, _ in gateway.client.calls if kind == "session.start")
    assert (placed, "session.interaction", sid) in gateway.client.calls  # sent to the worker that holds it

    client.send({"type": "session.ping"})
    assert client.until("session.pong")["request_id"] == sid
    client.send({"type": "session.stop"})
    done = client.until("session.done")
    assert done["request_id"] == sid and done["stopped"] is True and done["reason"] == "stopped"
    with pytest.raises(websockets_exceptions.ConnectionClosedOK):  # the gateway closes after session.done
        client.recv()


def test_a_dead_worker_ends_its_session_with_a_clear_event_and_others_go_on(gateway: Gateway) -> None:
    client, sid, placed = _streaming(gateway)
    assert gateway.client is not None
    gateway.client.kill(placed)
    lost = client.until("error")
    assert lost["error"]["type"] == "worker_lost" and lost["request_id"] == sid
    done = client.until("session.done")
    assert done["reason"] == "failed" and done["stopped"] is False
    with pytest.raises(websockets_exceptions.ConnectionClosed):
        client.recv()
    # A new session goes to the live worker and streams.
    other = Client(gateway.url)
    _start(other, "a boat")
    other.chunk()
    assert [i for i, kind, _ in gateway.client.calls if kind == "session.start"][-1] != placed
    other.close()


def test_a_client_that_leaves_ends_its_session_on_the_worker(gateway: Gateway) -> None:
    client, sid, placed = _streaming(gateway)
    assert gateway.client is not None
    worker = gateway.client.workers[placed]
    assert sid in worker.sessions
    client.close()
    deadline = time.monotonic() + 20
    while sid in worker.sessions and time.monotonic() < deadline:  # the worker drops it when its stream ends
        time.sleep(0.05)
    assert sid not in worker.sessions


def test_bad_messages_get_typed_errors_and_the_connection_lives(gateway: Gateway) -> None:
    client = Client(gateway.url)
    for message, error_type in (
        ("{not json", "invalid_json"),
        (json.dumps([1, 2]), "invalid_json"),
        (json.dumps({"type": "session.dance"}), "unknown_message_type"),
        (json.dumps({"type": "session.interaction", "interaction": {"event": {"prompt": "x"}}}), "no_session"),
        (json.dumps({"type": "session.ping", "pad": "x" * (70 * 2**10)}), "message_too_large"),
    ):
        client.ws.send(message)
        error = client.until("error")
        assert error["error"]["type"] == error_type, (message[:40], error)
    client.ws.send(b"\x00\x01")
    assert client.until("error")["error"]["type"] == "invalid_request"
    client.send({"type": "session.ping"})
    assert client.until("session.pong")["request_id"] is None
    _start(client)
    client.send({"type": "session.start", "prompt": "again"})
    assert client.until("error")["error"]["type"] == "session_active"
    # The worker's own checks reach the client too: a bad interaction names its field.
    client.send({"type": "session.interaction", "interaction": {"event": {"prompt": "  "}}})
    error = client.until("error")
    assert error["error"]["type"] == "invalid_request" and error["error"]["param"] == "interaction.event.prompt"
    client.chunk()  # the session streams on
    client.close()


def test_a_message_before_video_start_is_told_to_wait(gateway: Gateway) -> None:
    assert gateway.client is not None
    gateway.client.start_delay_s = 1.0  # the worker answers session.start only after this
    client = Client(gateway.url)
    client.send({"type": "session.start", "prompt": "a kite", "width": 16, "height": 16, "fps": FPS})
    client.send({"type": "session.ping"})
    error = client.until("error")
    assert error["error"]["type"] == "session_starting" and error["request_id"] is None
    sid = client.until("video.start")["request_id"]
    client.send({"type": "session.ping"})
    assert client.until("session.pong")["request_id"] == sid
    client.close()


def test_a_bad_session_start_is_answered_by_the_worker() -> None:
    g = Gateway()
    try:
        client = Client(g.url)
        client.send({"type": "session.start", "prompt": "a kite", "width": 10**6, "height": 16, "fps": FPS})
        error = client.until("error")
        assert error["error"]["type"] == "frame_too_large" and error["error"]["param"] == "width"
    finally:
        g.stop()


def test_the_api_key_guards_the_websocket() -> None:
    g = Gateway(api_key=API_KEY)
    try:
        with pytest.raises(websockets_exceptions.InvalidStatus):
            Client(g.url)
        with pytest.raises(websockets_exceptions.InvalidStatus):
            Client(g.url, additional_headers={"Authorization": "Bearer wrong"})
        for url, headers in ((g.url, {"Authorization": f"Bearer {API_KEY}"}), (f"{g.url}?api_key={API_KEY}", {})):
            client = Client(url, additional_headers=headers)
            client.send({"type": "session.ping"})
            assert client.until("session.pong")
            client.close()
    finally:
        g.stop()


def test_health_counts_the_workers(gateway: Gateway) -> None:
    response = httpx.get(f"{gateway.server.url}/health", timeout=10)
    assert response.status_code == 200 and response.json() == {"status": "ok", "workers": 2, "sessions": 0}
    assert gateway.client is not None
    gateway.client.kill(1)
    gateway.client.kill(2)
    response = httpx.get(f"{gateway.server.url}/health", timeout=10)
    assert response.status_code == 503 and response.json()["status"] == "no_workers"
