"""Following a video job of ``fv serve`` from a test, over its HTTP API (needs the serve extra);
``free_port`` for the server a test starts (the one fv's own launcher uses); ``RealtimeClient``, a
realtime WebSocket client as vLLM-Omni's clients speak the protocol."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:  # pragma: no cover
    import httpx

from fv_kernel.parallel.launch import free_port

__all__ = ["RealtimeClient", "wait_for_job", "job_progress", "read_sse", "free_port", "recording_loop_use"]


class RealtimeClient:
    """A vLLM-Omni-style realtime client for tests (``websockets``' sync client): JSON text messages out; in, JSON
    messages and one binary fMP4 frame after each ``video.chunk_metadata``."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        from websockets.sync.client import connect

        self._connect = connect(url, **kwargs)
        self.ws = self._connect.__enter__()

    def send(self, message: dict[str, Any]) -> None:
        self.ws.send(json.dumps(message))

    def recv(self, timeout: float = 20.0) -> Any:
        message = self.ws.recv(timeout=timeout)
        return json.loads(message) if isinstance(message, str) else message

    def until(self, kind: str, seen: list[Any] | None = None, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        """The next message of type ``kind`` whose fields equal ``match`` (earlier ones appended to ``seen``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.recv()
            if seen is not None:
                seen.append(message)
            if isinstance(message, dict) and message["type"] == kind and all(message.get(k) == v for k, v in match.items()):
                return message
        raise AssertionError(f"no {kind} {match} within {timeout} s")

    def chunk(self, seen: list[Any] | None = None, **match: Any) -> tuple[dict[str, Any], bytes]:
        """The next ``video.chunk_metadata`` matching ``match``, and the binary frame after it."""
        meta = self.until("video.chunk_metadata", seen, **match)
        binary = self.recv()
        assert isinstance(binary, bytes), "the frame after video.chunk_metadata must be binary"
        return meta, binary

    def close(self) -> None:
        self._connect.__exit__(None, None, None)


def wait_for_job(client: "httpx.Client", job_id: str, statuses: set[str], timeout_s: float = 600.0) -> dict[str, Any]:
    """Poll ``GET /v1/videos/{job_id}`` until its status is one of ``statuses``; the job's JSON."""
    deadline = time.monotonic() + timeout_s
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/videos/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never reached {statuses}: {job}")


def job_progress(client: "httpx.Client", job_id: str) -> list[tuple[str, int]]:
    """The (loop, step) of every progress event the server published for the job (its SSE stream)."""
    steps = []
    with client.stream("GET", f"/v1/videos/{job_id}/events") as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"loop_id"' in line:
                data = json.loads(line[6:])
                steps.append((data["loop_id"], data["step"]))
    return steps


def read_sse(response: Any) -> Iterator[dict[str, Any]]:
    """Events of an open SSE response (an httpx streaming response) as dicts:
    ``{"id": int | None, "event": str, "data": dict}`` (``server.shutdown`` carries no id)."""
    current: dict[str, Any] = {}
    for line in response.iter_lines():
        if line.startswith("id: "):
            current["id"] = int(line[4:])
        elif line.startswith("event: "):
            current["event"] = line[7:]
        elif line.startswith("data: "):
            current["data"] = json.loads(line[6:])
        elif line == "" and current:
            yield {"id": current.get("id"), "event": current["event"], "data": current["data"]}
            current = {}


def recording_loop_use(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[bool]]:
    """``fn`` wrapped to record, for each call, whether it ran in a thread with a running asyncio event loop: a
    test's check that blocking work (an encode, a file write) was moved off a server's loop."""
    on_a_loop: list[bool] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_a_loop.append(True)
        except RuntimeError:
            on_a_loop.append(False)
        return fn(*args, **kwargs)

    return wrapped, on_a_loop
