"""Realtime video sessions over the network (docs/realtime.md, "Realtime API").

``WS /v1/realtime/video`` speaks vLLM-Omni's protocol (``session.start`` / ``session.interaction``
/ ``session.stop`` / ``session.ping`` in; ``video.start``, ``video.chunk_metadata`` followed by
one binary fMP4 frame per chunk, ``session.interaction.queued``, ``session.pong``,
``session.done`` and ``error`` out), so a vLLM-Omni client works unchanged. fv adds fields and
events that such a client ignores: typed errors (``type``/``param``/``code``),
``session.prompt_applied``, ``video.status`` (fps, latency) and ``init_byte_length``.

The SSE fallback (for clients without WebSockets) carries the same messages: ``POST
/v1/realtime/video/sessions`` opens a session, ``GET .../{id}/events`` streams it (chunks
as base64 inside ``video.chunk`` events), ``POST .../{id}/interaction|stop|ping`` steer it.

Both sit on the engine's :class:`~fv_kernel.runtime.sessions.SessionHandle` only.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fv_kernel.errors import FvError
from fv_kernel.request.events import Event
from fv_kernel.request.session import SessionClosed, SessionRequest
from fv_kernel.runtime.sessions import SessionHandle
from fv_kernel.serving.errors import ApiError
from fv_kernel.serving.fmp4 import FragmentedMP4Writer
from fv_kernel.serving.media import preview_png

__all__ = [
    "ProtocolError", "RealtimeConnection", "RealtimeLimits", "RealtimeSession", "SessionStart", "WS_PATH",
    "chunk_as_json", "chunk_from_json", "mount_realtime", "open_realtime_session", "parse_client_message", "parse_interaction", "realtime_authorized",
]

log = logging.getLogger("fv.serving.realtime")

WS_PATH = "/v1/realtime/video"
SSE_PATH = "/v1/realtime/video/sessions"
PAGE_PATH = "/realtime"
_STATIC = Path(__file__).with_name("static")

OpenSession = Callable[[SessionRequest], SessionHandle]


class RealtimeLimits(BaseModel):
    """What one realtime session may ask for; larger asks get a typed ``error`` (the connection lives on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_width: int = Field(default=1920, gt=0)
    max_height: int = Field(default=1920, gt=0)
    #: width x height of one frame.
    max_frame_pixels: int = Field(default=1920 * 1088, gt=0)
    max_num_frames: int = Field(default=100_000, gt=0)
    #: A client text message longer than this is refused (a prompt is at most a few KB).
    max_message_bytes: int = Field(default=64 * 2**10, gt=0)
    #: Pacing: a chunk is sent at most this many seconds of playback ahead of the wall clock (counted
    #: from the first chunk), so a card faster than real time does not flood the client's buffer.
    #: None: send each chunk as soon as it is decoded.
    max_lead_s: float | None = Field(default=2.0, ge=0)
    #: Sessions open over SSE at once (each holds a server-side session until stopped or idle).
    max_sse_sessions: int = Field(default=64, gt=0)


class ProtocolError(Exception):
    """A client mistake: sent as an ``error`` event; the connection and its session live on."""

    def __init__(self, error_type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.error_type, self.message, self.param = error_type, message, param

    @classmethod
    def of(cls, exc: FvError) -> ProtocolError:
        info = exc.info()
        return cls(info["type"], info["message"], info["param"])

    def event(self, request_id: str | None = None) -> dict[str, Any]:
        # Both shapes vLLM-Omni's clients read: nested ``error`` and top-level ``message``/``code``.
        return {
            "type": "error", "request_id": request_id, "message": self.message, "code": self.error_type,
            "error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.error_type},
        }


# -- client messages ---------------------------------------------------------------------------
class ExtraParams(BaseModel):
    """``session.start``'s ``extra_params``: fv's own session options."""

    model_config = ConfigDict(extra="forbid")

    max_chunks: int | None = Field(default=None, ge=1)
    idle_timeout_s: float | None = Field(default=None, gt=0)
    max_ahead_chunks: int | None = Field(default=None, ge=1, le=64)
    #: fv extension: also send ``video.preview`` (a PNG of each chunk's early look) when the card makes previews.
    previews: bool = False


class SessionStart(BaseModel):
    """``session.start`` (and the body of the SSE ``POST``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["session.start"] = "session.start"
    model: str | None = None
    prompt: str
    format: Literal["m4s"] = "m4s"
    width: int | None = Field(default=None, gt=0)
    height: int | None = Field(default=None, gt=0)
    fps: float | None = Field(default=None, gt=0)
    #: Total frames to stream; the session ends (``stopped: false``) once they are sent.
    num_frames: int | None = Field(default=None, gt=0)
    #: Accepted for vLLM-Omni compatibility; a causal card's distilled recipe fixes its steps and guidance.
    num_inference_steps: int | None = Field(default=None, gt=0)
    guidance_scale: float | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    extra_params: ExtraParams = ExtraParams()
    image_reference: Any = None


class InteractionEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    negative_prompt: Any = None
    multi_modal_data: Any = None


class Interaction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    event_id: str | None = Field(default=None, min_length=1, max_length=128)
    event: InteractionEvent
    transition_chunks: int | None = Field(default=None, ge=0)


class SessionInteraction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["session.interaction"] = "session.interaction"
    interaction: Interaction


CLIENT_TYPES = ("session.start", "session.interaction", "session.stop", "session.ping")


def _validate(schema: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or "message"
        if first["type"] == "extra_forbidden":
            raise ProtocolError("unknown_field", f"{param}: unknown field", param) from None
        if first["type"] == "literal_error" and param == "format":
            raise ProtocolError("invalid_request", "format: only 'm4s' (fragmented MP4) is served; allowed: m4s", param)
        raise ProtocolError("invalid_request", f"{param}: {first['msg']}", param) from None


def _session_request(start: SessionStart, default_model: str | None, limits: RealtimeLimits) -> SessionRequest:
    """``session.start`` as the engine's :class:`SessionRequest`, checked against ``limits`` first."""
    if start.image_reference is not None:
        raise ProtocolError("unsupported", "image_reference: image-conditioned sessions are not served", "image_reference")
    for name, value, cap in (("width", start.width, limits.max_width), ("height", start.height, limits.max_height)):
        if value is not None and value > cap:
            raise ProtocolError("frame_too_large", f"{name}: {value} exceeds this server's limit of {cap}", name)
    if start.width is not None and start.height is not None and start.width * start.height > limits.max_frame_pixels:
        raise ProtocolError(
            "frame_too_large",
            f"width x height: {start.width}x{start.height} = {start.width * start.height} pixels exceeds this "
            f"server's limit of {limits.max_frame_pixels} per frame", "width",
        )
    if start.num_frames is not None and start.num_frames > limits.max_num_frames:
        raise ProtocolError("invalid_request",
                            f"num_frames: {start.num_frames} exceeds this server's limit of {limits.max_num_frames}",
                            "num_frames")
    model = start.model or default_model
    if model is None:
        raise ProtocolError("invalid_request", "model: required (this server serves several models)", "model")
    fields: dict[str, Any] = {"model": model, "prompt": start.prompt, "height": start.height, "width": start.width,
                              "fps": start.fps, "max_chunks": start.extra_params.max_chunks}
    if start.seed is not None:
        fields["seed"] = start.seed
    for name in ("idle_timeout_s", "max_ahead_chunks"):
        if getattr(start.extra_params, name) is not None:
            fields[name] = getattr(start.extra_params, name)
    if start.extra_params.previews:
        fields["previews"] = True
    try:
        return SessionRequest.of(**fields)
    except FvError as exc:
        raise ProtocolError.of(exc) from None


def open_realtime_session(
    open_session: OpenSession, data: dict[str, Any], *, default_model: str | None, limits: RealtimeLimits,
) -> RealtimeSession:
    """Validate ``session.start``'s fields (``type`` optional), open the engine session, wrap it.

    Raises :class:`ProtocolError` for anything the client got wrong (the engine's typed errors too).
    """
    start = _validate(SessionStart, {**data, "type": "session.start"})
    request = _session_request(start, default_model, limits)
    try:
        handle = open_session(request)
    except FvError as exc:
        raise ProtocolError.of(exc) from None
    return RealtimeSession(handle, start, limits.max_lead_s)


def parse_interaction(data: dict[str, Any]) -> Interaction:
    """``session.interaction``'s ``interaction`` (``type`` optional), or a :class:`ProtocolError` naming the field."""
    return _validate(SessionInteraction, {**data, "type": "session.interaction"}).interaction


def chunk_as_json(meta: dict[str, Any], binary: bytes) -> dict[str, Any]:
    """A chunk for text-only transports (SSE, Dynamo): ``video.chunk`` = the metadata plus ``data`` (base64 fMP4)."""
    return {**meta, "type": "video.chunk", "data": base64.b64encode(binary).decode()}


def chunk_from_json(message: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """:func:`chunk_as_json` undone: the ``video.chunk_metadata`` message and the fMP4 bytes, as the WebSocket
    sends them (a gateway that relays chunks from a text-only transport)."""
    meta = {k: v for k, v in message.items() if k != "data"}
    meta["type"] = "video.chunk_metadata"
    return meta, base64.b64decode(message["data"])


# -- one session's protocol state --------------------------------------------------------------
class RealtimeSession:
    """Turns a :class:`SessionHandle`'s events into protocol messages and client messages into handle calls.

    :meth:`messages` yields ``(json, binary)`` pairs: ``binary`` is the chunk's fMP4 bytes
    after its ``video.chunk_metadata``, else None.
    """

    def __init__(self, handle: SessionHandle, start: SessionStart, max_lead_s: float | None = None) -> None:
        self.handle = handle
        self.max_lead_s = max_lead_s
        self._first_sent: float | None = None
        self.start = start
        self.request_id = handle.session_id
        self.stopped = False
        self.done = False
        self._writer: FragmentedMP4Writer | None = None
        self._event_ids: dict[int, str] = {}  # prompt version -> the client's event id
        self._active_version = 0
        self._frames_sent = 0
        self._transport_index = 0
        self._last_chunk: float | None = None
        #: num_frames were sent: later chunks (already in flight when the session was told to stop) are dropped.
        self._complete = False
        self._gone = False

    # client operations
    def interact(self, interaction: Interaction) -> tuple[str, int]:
        event = interaction.event
        for name in ("negative_prompt", "multi_modal_data"):
            if getattr(event, name) is not None:
                raise ProtocolError("unsupported", f"interaction.event.{name}: not supported by fv sessions; "
                                    "allowed: prompt", f"interaction.event.{name}")
        if interaction.transition_chunks not in (None, 0):
            raise ProtocolError("unsupported", "interaction.transition_chunks: prompt updates apply at the next "
                                "chunk boundary; allowed: 0", "interaction.transition_chunks")
        if event.prompt is None or not event.prompt.strip():
            raise ProtocolError("invalid_request", "interaction.event.prompt: a non-blank prompt is required",
                                "interaction.event.prompt")
        if self.stopped or self.ended:
            raise ProtocolError("session_closed", "session.interaction: the session has been stopped", "interaction")
        event_id = interaction.event_id or f"evt_{uuid.uuid4().hex[:12]}"
        try:
            version = self.handle.push_text(event.prompt, event_id)
        except SessionClosed as exc:
            raise ProtocolError.of(exc) from None
        except FvError as exc:  # the handle reported it as session.error too; that event is dropped below
            raise ProtocolError.of(exc) from None
        self._event_ids[version] = event_id
        return event_id, version

    @property
    def ended(self) -> bool:
        """The session is over (or ending): done, its client gone, or closed in the engine."""
        return self.done or self._gone or self.handle.closed

    def stop(self) -> None:
        if self.ended:
            raise ProtocolError("session_closed", "session.stop: the session has already ended", "type")
        if not self.stopped:
            self.stopped = True
            self.handle.stop()

    def ping(self) -> None:
        if not self.done and not self.handle.closed:
            try:
                self.handle.touch()
            except SessionClosed:
                pass

    def disconnect(self) -> None:
        self._gone = True
        if not self.done and not self.handle.closed:
            try:
                self.handle.cancel("session")
            except SessionClosed:
                pass  # already ending (stopped, idle)

    # server messages
    async def messages(self) -> AsyncIterator[tuple[dict[str, Any], bytes | None]]:
        async for event in self.handle.events():
            async for item in self._translate(event):
                yield item
            if self.done:
                return

    async def _translate(self, event: Event) -> AsyncIterator[tuple[dict[str, Any], bytes | None]]:
        rid = self.request_id
        kind = event.type
        if kind == "session.started":
            self._writer = FragmentedMP4Writer(event.fps)  # type: ignore[union-attr]
            config = {
                "model": event.model, "width": event.width, "height": event.height,  # type: ignore[union-attr]
                "fps": event.fps, "num_frames": self.start.num_frames,  # type: ignore[union-attr]
                "max_chunks": event.max_chunks,  # type: ignore[union-attr]
                "seed": self.handle.request.seed,
                # The causal card's recipe fixes these; a client's values are not used.
                "ignored": [n for n in ("num_inference_steps", "guidance_scale")
                            if getattr(self.start, n) is not None],
            }
            yield {"type": "video.start", "request_id": rid, "format": "m4s", "config": config}, None
        elif kind == "session.prompt_queued":
            return  # acknowledged by the caller of interact (session.interaction.queued)
        elif kind == "session.prompt_applied":
            yield {"type": "session.prompt_applied", "request_id": rid, "version": event.version,  # type: ignore[union-attr]
                   "event_id": self._event_ids.get(event.version),  # type: ignore[union-attr]
                   "chunk_index": event.chunk_index}, None  # type: ignore[union-attr]
        elif kind == "media.chunk" and event.frames is not None and event.preview:  # type: ignore[union-attr]
            yield await self._preview(event), None
        elif kind == "media.chunk" and event.frames is not None:  # type: ignore[union-attr]
            async for item in self._chunk(event):
                yield item
        elif kind == "session.error":
            if event.error.type in ("invalid_request",) and event.event_id is not None:  # type: ignore[union-attr]
                return  # a rejected push_text: interact() already answered it
            error = ProtocolError(event.error.type, event.error.message, event.error.param)  # type: ignore[union-attr]
            yield error.event(rid), None
        elif kind == "session.closed":
            reason = event.reason  # type: ignore[union-attr]
            if reason == "failed" and event.error is not None:  # type: ignore[union-attr]
                err = event.error  # type: ignore[union-attr]
                yield ProtocolError(err.type, err.message, err.param).event(rid), None
            self.done = True
            if self._complete and not self.stopped:
                reason = "completed"
            yield {"type": "session.done", "request_id": rid, "chunks": self._transport_index,
                   "stopped": self.stopped or reason in ("stopped", "cancelled"), "reason": reason}, None

    async def _chunk(self, event: Any) -> AsyncIterator[tuple[dict[str, Any], bytes | None]]:
        if self._complete:
            return
        if self._writer is None:  # a resumed session: no session.started
            self._writer = FragmentedMP4Writer(event.fps or 16.0)
        frames = event.frames
        limit = self.start.num_frames
        last = False
        if limit is not None and self._frames_sent + frames.shape[0] >= limit:
            frames = frames[: limit - self._frames_sent]
            last = True
        fragment = await asyncio.to_thread(self._writer.encode, frames)
        if self.max_lead_s is not None and self._first_sent is not None:
            due = self._first_sent + float(fragment.frame_start / self._writer.fps) - self.max_lead_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        payload = fragment.payload
        version = event.prompt_version or 0
        active = self._event_ids.get(version)
        started, completed = [], []
        if version != self._active_version:
            if active is not None:
                started.append(active)
            previous = self._event_ids.get(self._active_version)
            if previous is not None:
                completed.append(previous)
            # Versions skipped over (two updates within one chunk) were never shown.
            completed += [self._event_ids[v] for v in sorted(self._event_ids) if self._active_version < v < version]
            self._active_version = version
        now = time.monotonic()
        if self._first_sent is None:
            self._first_sent = now
        meta = {
            "type": "video.chunk_metadata", "request_id": self.request_id, "kind": "media",
            "transport_chunk_index": self._transport_index, "generation_chunk_index": event.index,
            "num_frames": fragment.num_frames, "byte_length": len(payload),
            "started_event_ids": started, "active_event_ids": [active] if active else [],
            "completed_event_ids": completed,
            # fv: the first chunk's payload starts with the init segment (ftyp+moov) of this many bytes.
            "init_byte_length": len(fragment.init or b""), "frame_start": fragment.frame_start,
            "prompt_version": version, "mime": self._writer.mime,
        }
        self._transport_index += 1
        self._frames_sent += fragment.num_frames
        yield meta, payload
        # Generation speed from the engine's own timestamps (pacing and encoding excluded).
        interval = event.ts - self._last_chunk if self._last_chunk is not None else None
        self._last_chunk = event.ts
        yield {"type": "video.status", "request_id": self.request_id, "chunks": self._transport_index,
               "frames": self._frames_sent, "chunk_interval_s": round(interval, 4) if interval is not None else None,
               "generation_fps": round(event.num_frames / interval, 3) if interval else None,
               "send_delay_s": round(max(0.0, time.time() - event.ts), 4)}, None
        if last:
            self._complete = True
            if not self.handle.closed:
                self.handle.stop()

    async def _preview(self, event: Any) -> dict[str, Any]:
        """fv's ``video.preview``: the last frame of a chunk's early look, as a PNG (base64), with the index and
        frame range of the final chunk that follows it. Only sessions that asked (``extra_params.previews``) get them.
        The PNG is encoded on a thread, as fragments are: at 480x832 it would hold the event loop."""
        png = await asyncio.to_thread(preview_png, event.frames)
        return {"type": "video.preview", "request_id": self.request_id, "generation_chunk_index": event.index,
                "frame_start": event.frame_start, "num_frames": event.num_frames,
                "prompt_version": event.prompt_version or 0, "mime": "image/png",
                "image": base64.b64encode(png).decode() if png is not None else None}


def parse_client_message(text: str, limits: RealtimeLimits) -> dict[str, Any]:
    """A client's text message as a dict with a known ``type``, or a :class:`ProtocolError` saying what is wrong
    (too large, not JSON, not an object, an unknown type)."""
    if len(text.encode()) > limits.max_message_bytes:
        raise ProtocolError("message_too_large", f"a message is at most {limits.max_message_bytes} bytes", "message")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError("invalid_json", f"message: not JSON ({exc.msg})", "message") from None
    if not isinstance(data, dict):
        raise ProtocolError("invalid_json", "message: a JSON object is required", "message")
    kind = data.get("type")
    if kind not in CLIENT_TYPES:
        raise ProtocolError("unknown_message_type", f"type: unknown message type {kind!r}; allowed: "
                            + ", ".join(CLIENT_TYPES), "type")
    return data


def realtime_authorized(api_key: str | None, headers: Any, query: Any) -> bool:
    """Whether a WebSocket handshake carries ``api_key`` (``Authorization: Bearer`` or ``?api_key=``); True without one."""
    if api_key is None:
        return True
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    supplied = token.strip() if scheme.lower() == "bearer" else (query.get("api_key") or "")
    return hmac.compare_digest(supplied.encode(), api_key.encode())


# -- the WebSocket endpoint ----------------------------------------------------------------------
class RealtimeConnection(abc.ABC):
    """One WebSocket connection of the realtime protocol: reads the client's messages, answers each mistake
    with a typed ``error`` event (the connection lives on), and sends a chunk's metadata and its binary frame
    adjacent. Subclasses act on valid messages (:meth:`handle`), name their session (:attr:`request_id`) and
    clean up when the client goes (:meth:`closed`): ``fv serve``'s connection over the engine, or a
    gateway's over workers elsewhere."""

    def __init__(self, ws: WebSocket, limits: RealtimeLimits) -> None:
        self.ws = ws
        self.limits = limits
        self.send_lock = asyncio.Lock()

    @property
    def request_id(self) -> str | None:
        """The connection's session id, once known (error events carry it)."""
        return None

    @abc.abstractmethod
    async def handle(self, data: dict[str, Any]) -> None:
        """Act on one valid client message (its ``type`` is one of ``CLIENT_TYPES``); raise :class:`ProtocolError`
        for a client mistake."""

    def closed(self) -> None:
        """The client has gone (or the loop ended): release what the connection holds."""

    async def send(self, message: dict[str, Any], binary: bytes | None = None) -> None:
        async with self.send_lock:  # a chunk's metadata and its binary frame stay adjacent
            await self.ws.send_text(json.dumps(message, separators=(",", ":")))
            if binary is not None:
                await self.ws.send_bytes(binary)

    async def run(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                try:
                    if message.get("text") is None:
                        raise ProtocolError("invalid_request", "binary frames are not accepted; send JSON text", "message")
                    await self.handle(parse_client_message(message["text"], self.limits))
                except ProtocolError as exc:
                    await self.send(exc.event(self.request_id))
        except WebSocketDisconnect:
            return
        finally:
            self.closed()


class _Connection(RealtimeConnection):
    def __init__(self, ws: WebSocket, open_session: OpenSession, default_model: Callable[[], str | None],
                 limits: RealtimeLimits) -> None:
        super().__init__(ws, limits)
        self.open_session = open_session
        self.default_model = default_model
        self.session: RealtimeSession | None = None
        self.pump: asyncio.Task[None] | None = None

    @property
    def request_id(self) -> str | None:
        return self.session.request_id if self.session is not None else None

    def closed(self) -> None:
        if self.session is not None:
            self.session.disconnect()
        if self.pump is not None:
            self.pump.cancel()

    async def handle(self, data: dict[str, Any]) -> None:
        kind = data["type"]
        session = self.session
        if kind == "session.ping":
            if session is not None:
                session.ping()
            await self.send({"type": "session.pong", "request_id": session.request_id if session else None})
            return
        if kind == "session.start":
            if session is not None:
                raise ProtocolError("session_active", "session.start: this connection already has a session; "
                                    "stop it and open a new connection", "type")
            self.session = open_realtime_session(self.open_session, data, default_model=self.default_model(),
                                                 limits=self.limits)
            self.pump = asyncio.create_task(self._pump(self.session))
            return
        if session is None:
            raise ProtocolError("no_session", f"{kind}: no session yet; send session.start first", "type")
        session.ping()  # any client message keeps the session from idling out
        if kind == "session.interaction":
            event_id, version = session.interact(parse_interaction(data))
            await self.send({"type": "session.interaction.queued", "request_id": session.request_id,
                             "event_id": event_id, "version": version})
        elif kind == "session.stop":
            session.stop()

    async def _pump(self, session: RealtimeSession) -> None:
        try:
            async for message, binary in session.messages():
                await self.send(message, binary)
                if binary is not None:
                    session.ping()  # a client reading chunks is present
            await self.ws.close(1000)
        except (WebSocketDisconnect, RuntimeError):
            session.disconnect()  # the client went away mid-send
        except Exception as exc:  # noqa: BLE001 - an encoder fault ends the session with a clear event
            log.exception("realtime session %s failed", session.request_id)
            session.disconnect()
            with _suppress():
                await self.send(ProtocolError("internal_error", f"{type(exc).__name__}: {exc}").event(session.request_id))
                await self.ws.close(1011)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


# -- SSE fallback -----------------------------------------------------------------------------------
#: An ended SSE session is remembered this long, so a late POST hears "session_closed", not 404.
_SSE_RETAIN_S = 300.0


class _SseSession:
    def __init__(self, session: RealtimeSession) -> None:
        self.session = session
        self.attached = False
        self.ended_at: float | None = None


def _sse(message: dict[str, Any]) -> bytes:
    return f"event: {message['type']}\ndata: {json.dumps(message, separators=(',', ':'))}\n\n".encode()


def mount_realtime(
    app: FastAPI,
    open_session: OpenSession,
    *,
    models: Callable[[], list[str]],
    api_key: str | None = None,
    limits: RealtimeLimits | None = None,
    heartbeat_s: float = 15.0,
) -> None:
    """Add the realtime routes to ``app``: the WebSocket, the SSE fallback and the ``/realtime`` page.

    They stay out of ``/openapi.json`` (a WebSocket and a session protocol it cannot describe);
    docs/realtime.md is their reference.

    ``models`` lists the served models (``session.start`` may omit ``model`` when there is one).
    The WebSocket checks ``api_key`` itself (``Authorization: Bearer`` or ``?api_key=``): the
    HTTP auth middleware does not see WebSocket handshakes.
    """
    limits = limits or RealtimeLimits()
    sse_sessions: dict[str, _SseSession] = {}
    router = APIRouter()

    def default_model() -> str | None:
        served = models()
        return served[0] if len(served) == 1 else None

    @router.websocket(WS_PATH)
    async def realtime_video(ws: WebSocket) -> None:
        if not realtime_authorized(api_key, ws.headers, ws.query_params):
            await ws.close(code=1008, reason="missing or invalid API key")
            return
        await ws.accept()
        await _Connection(ws, open_session, default_model, limits).run()

    def _sse_session(session_id: str) -> _SseSession:
        entry = sse_sessions.get(session_id)
        if entry is None:
            raise ApiError(404, "not_found", f"session_id: no realtime session {session_id!r}", param="session_id")
        return entry

    async def _json(request: Request) -> dict[str, Any]:
        body = await request.body()
        if len(body) > limits.max_message_bytes:
            raise ApiError(413, "message_too_large", f"a message is at most {limits.max_message_bytes} bytes")
        try:
            data = json.loads(body or b"{}")
        except json.JSONDecodeError as exc:
            raise ApiError(400, "invalid_json", f"body: not JSON ({exc.msg})", param="body") from None
        if not isinstance(data, dict):
            raise ApiError(400, "invalid_json", "body: a JSON object is required", param="body")
        return data

    def _api(exc: ProtocolError) -> ApiError:
        status = 409 if exc.error_type in ("session_closed",) else 413 if exc.error_type == "frame_too_large" else 400
        return ApiError(status, exc.error_type, exc.message, param=exc.param)

    @router.post(SSE_PATH, status_code=201, include_in_schema=False)
    async def sse_start(request: Request) -> JSONResponse:
        now = time.monotonic()
        for sid, entry in list(sse_sessions.items()):
            if entry.ended_at is None and not entry.attached and entry.session.handle.closed:
                entry.ended_at = now  # ended (idle) before anyone read its stream
            if entry.ended_at is not None and now - entry.ended_at > _SSE_RETAIN_S:
                del sse_sessions[sid]
        live = sum(1 for e in sse_sessions.values() if e.ended_at is None)
        if live >= limits.max_sse_sessions:
            raise ApiError(429, "too_many_sessions", f"at most {limits.max_sse_sessions} SSE sessions are open")
        data = await _json(request)
        try:
            session = open_realtime_session(open_session, data, default_model=default_model(), limits=limits)
        except ProtocolError as exc:
            raise _api(exc) from None
        sid = session.request_id
        sse_sessions[sid] = _SseSession(session)
        base = f"{SSE_PATH}/{sid}"
        return JSONResponse({"request_id": sid, "events_url": f"{base}/events", "interaction_url": f"{base}/interaction",
                             "stop_url": f"{base}/stop", "ping_url": f"{base}/ping"}, status_code=201)

    @router.get(SSE_PATH + "/{session_id}/events", include_in_schema=False)
    async def sse_events(session_id: str) -> StreamingResponse:
        entry = _sse_session(session_id)
        if entry.attached:
            raise ApiError(409, "stream_attached", "this session's event stream is already being read", param="session_id")
        entry.attached = True
        session = entry.session

        async def body() -> AsyncIterator[bytes]:
            messages = session.messages().__aiter__()
            pending: asyncio.Task[Any] | None = None
            try:
                while True:
                    pending = pending or asyncio.ensure_future(messages.__anext__())
                    finished, _ = await asyncio.wait({pending}, timeout=heartbeat_s)
                    if not finished:
                        yield b": keep-alive\n\n"
                        continue
                    try:
                        message, binary = pending.result()
                    except StopAsyncIteration:
                        break
                    pending = None
                    if binary is not None:
                        message = chunk_as_json(message, binary)
                        session.ping()
                    yield _sse(message)
            finally:
                if pending is not None:
                    pending.cancel()
                if not session.done:
                    session.disconnect()  # the reader went away
                entry.ended_at = time.monotonic()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @router.post(SSE_PATH + "/{session_id}/interaction", status_code=202, include_in_schema=False)
    async def sse_interaction(session_id: str, request: Request) -> JSONResponse:
        entry = _sse_session(session_id)
        data = await _json(request)
        try:
            interaction = parse_interaction(data)
            entry.session.ping()
            event_id, version = entry.session.interact(interaction)
        except ProtocolError as exc:
            raise _api(exc) from None
        return JSONResponse({"type": "session.interaction.queued", "request_id": session_id, "event_id": event_id,
                             "version": version}, status_code=202)

    @router.post(SSE_PATH + "/{session_id}/stop", status_code=202, include_in_schema=False)
    async def sse_stop(session_id: str) -> JSONResponse:
        entry = _sse_session(session_id)
        try:
            entry.session.stop()
        except ProtocolError as exc:
            raise _api(exc) from None
        return JSONResponse({"type": "session.stopping", "request_id": session_id}, status_code=202)

    @router.post(SSE_PATH + "/{session_id}/ping", include_in_schema=False)
    async def sse_ping(session_id: str) -> JSONResponse:
        entry = _sse_session(session_id)
        if entry.session.ended:
            raise ApiError(409, "session_closed", "session.ping: the session has ended", param="session_id")
        entry.session.ping()
        return JSONResponse({"type": "session.pong", "request_id": session_id})

    @router.get(PAGE_PATH, include_in_schema=False)
    async def realtime_page() -> FileResponse:
        return FileResponse(_STATIC / "realtime.html", media_type="text/html")

    @router.get(PAGE_PATH + "/realtime.js", include_in_schema=False)
    async def realtime_script() -> FileResponse:
        return FileResponse(_STATIC / "realtime.js", media_type="text/javascript")

    app.include_router(router)
