"""Session-affine routing of realtime sessions across fv workers.

A realtime session's state (its chunk K/V, the VAE's causal cache) lives in the engine of the
worker that runs it, so every message of a session must reach that worker. :class:`SessionRouter`
places a session on the worker with the fewest sessions it placed (ties: the lower instance id),
remembers where, and sends the session's later messages there with Dynamo's direct routing.
A worker that dies takes its sessions with it: their streams end with an ``error``
(``worker_lost``) and ``session.done`` (``reason: "failed"``), and a later message for such a
session gets the same ``worker_lost`` error instead of reaching another worker that never held it.

Messages are vLLM-Omni's realtime video protocol as JSON (docs/realtime.md); chunks arrive as
``video.chunk`` (the metadata plus the fMP4 in base64).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SessionRouter"]

log = logging.getLogger("fv.dynamo.sessions")


def _error(error_type: str, message: str, request_id: str | None, param: str | None = None) -> dict[str, Any]:
    return {"type": "error", "request_id": request_id,
            "error": {"message": message, "type": error_type, "param": param, "code": error_type}}


@dataclass
class SessionRouter:
    """Routes realtime sessions over the workers of one ``realtime`` endpoint client (``Client.direct``)."""

    client: Any
    #: session id -> the worker instance that holds it.
    placement: dict[str, int] = field(default_factory=dict)
    _load: Counter[int] = field(default_factory=Counter)
    #: Sessions that ended -> how ("session_closed" or "worker_lost"), so a late message hears why; bounded.
    _ended: dict[str, str] = field(default_factory=dict)

    def choose(self) -> int | None:
        ids = sorted(self.client.instance_ids())
        return min(ids, key=lambda i: (self._load[i], i)) if ids else None

    async def start(self, message: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Open a session (``session.start``) on a worker and yield its messages until ``session.done``."""
        target = self.choose()
        if target is None:
            yield _error("no_workers", "no fv worker serves realtime sessions right now", None)
            return
        self._load[target] += 1
        session_id: str | None = None
        chunks = 0
        ended = "session_closed"
        try:
            try:
                stream = await self.client.direct({**message, "type": "session.start"}, target)
                async for item in stream:
                    data = item.data()
                    if session_id is None and data.get("type") == "video.start":
                        session_id = data["request_id"]
                        self.placement[session_id] = target
                    chunks += data.get("type") == "video.chunk"
                    yield data
                    if data.get("type") == "session.done" or (session_id is None and data.get("type") == "error"):
                        return
                lost = "its stream ended without session.done"
            except Exception as exc:  # noqa: BLE001 - any transport failure means the worker is gone
                lost = f"{type(exc).__name__}: {exc}"
            ended = "worker_lost"
            log.warning("realtime session %s: worker %s lost (%s)", session_id, target, lost)
            yield _error("worker_lost", f"the worker holding this session ({target}) is gone ({lost}); the session's "
                         "state was on it, so the session has ended: start a new one", session_id)
            yield {"type": "session.done", "request_id": session_id, "chunks": chunks, "stopped": False,
                   "reason": "failed"}
        finally:
            self._load[target] -= 1
            if session_id is not None:
                self.placement.pop(session_id, None)
                self._ended[session_id] = ended
                while len(self._ended) > 10_000:
                    del self._ended[next(iter(self._ended))]

    async def send(self, session_id: str, message: Mapping[str, Any]) -> dict[str, Any]:
        """A ``session.interaction`` / ``session.stop`` / ``session.ping`` for ``session_id``: its one answer."""
        target = self.placement.get(session_id)
        if target is None:
            how = self._ended.get(session_id)
            if how == "worker_lost":
                return _error(how, f"the worker holding session {session_id!r} is gone; the session has ended", session_id)
            if how is not None:
                return _error(how, f"session_id: session {session_id!r} has ended", session_id, "session_id")
            return _error("not_found", f"session_id: no realtime session {session_id!r}", session_id, "session_id")
        if target not in self.client.instance_ids():
            return _error("worker_lost", f"the worker holding session {session_id!r} ({target}) is gone; "
                          "the session has ended", session_id)
        try:
            stream = await self.client.direct({**message, "session_id": session_id}, target)
            async for item in stream:
                return item.data()
        except Exception as exc:  # noqa: BLE001 - the worker went away mid-call
            return _error("worker_lost", f"the worker holding session {session_id!r} ({target}) is gone "
                          f"({type(exc).__name__}: {exc})", session_id)
        return _error("worker_lost", f"the worker holding session {session_id!r} ({target}) sent no answer", session_id)
