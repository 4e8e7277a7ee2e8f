"""Realtime sessions on the Engine (design §12): admitted, priced and scheduled like requests.

A session is one request that runs its card's ``chunk_rollout`` loop through the normal
driver, with the engine's executor: every step is a WorkUnit in the one scheduler,
interleaved (and batched where it can) with other sessions and batch jobs. Admission
reserves the loop's whole-life estimate (its chunk-KV window's slabs included) like any
request's; a session that does not fit waits in the queue, one that can never fit is
refused at once (``CapacityError``).

The client side talks to the session only between steps: the driver's ``on_state`` hook
(:meth:`SessionManager._on_state`) drains decoded chunks into ``media.chunk`` events,
hands queued prompt updates to the loop (applied at its next chunk boundary), honours a
``stream`` cancel and a suspend. Ending the session (stop, cancel, idle timeout) goes
through the request's cancel token, so the driver stops at the next step boundary.

A suspended session is bytes: the session request, the loop state with its pool K/V
copied in (:meth:`ChunkRolloutLoop.suspend`) and the stream position.
:meth:`SessionManager.resume` continues it, in this process or another, bit-identically.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from typing import Any, AsyncIterator, Callable

import torch

from fv_kernel.errors import (
    CapacityError,
    FvError,
    InvalidRequest,
    RequestCancelled,
    UnknownModel,
)
from fv_kernel.loop.contract import LoopContext
from fv_kernel.loop.driver import LoopCancelled, drive
from fv_kernel.loop.realtime import (
    SESSION_UPSTREAM,
    ChunkRolloutLoop,
    ChunkRolloutState,
    ReadyChunk,
)
from fv_kernel.model.instance import ModelInstance
from fv_kernel.request.events import ErrorInfo, Event
from fv_kernel.request.request import DiffusionParams, OutputSpec, Request, TextPart
from fv_kernel.request.session import (
    MAX_PROMPT_CHARS,
    SessionClosed,
    SessionRequest,
    check_cancel_scope,
)
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.admission import Reservation
from fv_kernel.runtime.pricing import price_estimate
from fv_kernel.runtime.records import EVENT_CLASSES, GenerationResult, RequestRecord
from fv_kernel.state import StateFormatError

__all__ = ["SESSION_FORMAT", "VIDEO_STREAM", "SessionHandle", "SessionManager", "SessionRecord"]

log = logging.getLogger("fv.sessions")

#: The format tag of a suspended session's bytes.
SESSION_FORMAT = "fv.session/1"
#: The stream id of a session's video chunks.
VIDEO_STREAM = "video"
#: Events a session never keeps in its history (a long session would grow without bound);
#: they reach the subscribers listening when they are emitted.
_LIVE_ONLY = frozenset({"media.chunk"})
#: Request events a session's stream carries under its own names (the rest are dropped:
#: a session reports its own start, progress and end).
#: How often a paused (backpressured) session looks whether its listeners caught up.
_PACE_POLL_S = 0.005
_DROPPED = frozenset({"request.started", "request.completed", "progress", "behavior.slice"})


class _Listener:
    """One ``events()`` subscriber: its queue, and the chunks put in it that it has not taken yet."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.pending_chunks = 0


class SessionRecord(RequestRecord):
    """The engine's record of one session: a request record whose stream is session events."""

    def __init__(
        self, request: Request, instance: ModelInstance, loop: asyncio.AbstractEventLoop, session: SessionRequest,
        *, resume_state: ChunkRolloutState | None = None, chunks_emitted: int = 0,
    ) -> None:
        super().__init__(request, instance, loop)
        self.session = session
        self.resume_state = resume_state
        #: Prompt updates waiting for the next step boundary: (prompt, version).
        self.inbox: list[tuple[str, int]] = []
        latest = 0 if resume_state is None else max(resume_state.prompt_version, resume_state.pending_version or 0)
        self.next_version = latest + 1
        self.applied_version = 0 if resume_state is None else resume_state.prompt_version
        self.stream_cancel = False
        self.suspend_waiter: asyncio.Future[bytes] | None = None
        self.last_activity = time.monotonic()
        #: Why the session is ending, once a stop, cancel, idle timeout or suspend asked it to.
        self.close_reason: str | None = None
        self.chunks_emitted = chunks_emitted
        self.stream_open = False
        self.state: ChunkRolloutState | None = resume_state
        self._seq = 0
        #: Every event until the first subscriber attaches (it sees the whole stream).
        self._early: list[Event] | None = []
        self.listeners: list[_Listener] = []
        self.watchdog: asyncio.Task[None] | None = None

    @property
    def session_id(self) -> str:
        return self.request.request_id

    def emit(self, event_type: str, **fields: Any) -> None:
        if event_type in _DROPPED:
            return
        if event_type == "request.failed":
            event_type, fields = "session.closed", {"reason": "failed", "chunks": self.chunks_emitted, **fields}
        elif event_type == "request.cancelled":
            fields = {"reason": self.close_reason or "cancelled", "chunks": self.chunks_emitted}
            event_type = "session.closed"
        event_cls = EVENT_CLASSES.get(event_type)
        if event_cls is None:
            raise ValueError(f"unknown event type {event_type!r}; allowed: {sorted(EVENT_CLASSES)}")
        event = event_cls(request_id=self.session_id, seq=self._seq, **fields)
        self._seq += 1
        if event_type not in _LIVE_ONLY:
            self.events.append(event)
        if self._early is not None:
            self._early.append(event)
        for listener in self.listeners:
            listener.queue.put_nowait(event)
            if event_type == "media.chunk":
                listener.pending_chunks += 1

    def chunks_ahead(self) -> int:
        """Chunks emitted that the slowest listener (or, before the first, nobody) has not taken."""
        if self._early is not None:
            return sum(1 for e in self._early if e.type == "media.chunk")
        return max((listener.pending_chunks for listener in self.listeners), default=0)

    @property
    def ended(self) -> bool:
        """The session has ended or is ending (no more client operations are accepted)."""
        return self.finished or self.close_reason is not None


class SessionHandle:
    """The client's view of a session: its events, prompt updates, cancel, suspend and keep-alive."""

    def __init__(self, record: SessionRecord, manager: "SessionManager") -> None:
        self._record = record
        self._manager = manager

    @property
    def session_id(self) -> str:
        return self._record.session_id

    @property
    def request(self) -> SessionRequest:
        return self._record.session

    @property
    def closed(self) -> bool:
        return self._record.finished

    @property
    def close_reason(self) -> str | None:
        """``stopped``, ``idle_timeout``, ``completed``, ``failed``, ``cancelled`` or ``suspended`` once ended."""
        for event in reversed(self._record.events):
            if event.type == "session.closed":
                return event.reason  # type: ignore[union-attr]
        return None

    async def events(self) -> AsyncIterator[Event]:
        """The session's events in order until ``session.closed``.

        The first subscriber sees every event from the start; a later one sees the
        session events so far (not past media chunks), then everything live.
        """
        record = self._record
        listener = _Listener()
        if record._early is not None:
            history, record._early = record._early, None
        else:
            history = list(record.events)
        listener.pending_chunks = sum(1 for e in history if e.type == "media.chunk")
        record.listeners.append(listener)
        try:
            last = -1
            for event in history:
                last = event.seq
                yield event
                if event.type == "media.chunk":
                    listener.pending_chunks -= 1  # taken: the caller asked for the next event
                if event.type == "session.closed":
                    return
            while True:
                event = await listener.queue.get()
                if event.seq <= last:
                    continue
                yield event
                if event.type == "media.chunk":
                    listener.pending_chunks -= 1
                if event.type == "session.closed":
                    return
        finally:
            record.listeners.remove(listener)

    def push_text(self, prompt: str, event_id: str | None = None) -> int:
        """Queue a prompt update; returns its version. It applies at the next chunk boundary
        (``session.prompt_queued`` now, ``session.prompt_applied`` when it does)."""
        return self._manager.push_text(self._record, prompt, event_id)

    def cancel(self, scope: str = "session") -> None:
        """``stream``: drop what is not emitted yet (the chunk in progress too) and continue with fresh
        chunks. ``session`` (or ``request``/``loop``): end the session (reason ``cancelled``)."""
        self._manager.cancel(self._record, scope)

    def stop(self) -> None:
        """End the session at the next step boundary (reason ``stopped``)."""
        self._manager.end(self._record, "stopped")

    async def suspend(self) -> bytes:
        """Serialize the session at the next step boundary (its K/V included) and end it (reason
        ``suspended``). :meth:`SessionManager.resume` / ``Engine.resume_session`` continues it."""
        return await self._manager.suspend(self._record)

    def touch(self) -> None:
        """A keep-alive: resets the idle timer."""
        if self._record.ended:
            raise SessionClosed(self.session_id, self._record.close_reason or "ended", "touch")
        self._record.last_activity = time.monotonic()

    async def wait_closed(self) -> str:
        """Wait for the session to end; returns its close reason."""
        await asyncio.shield(self._record.done)
        return self.close_reason or "cancelled"


class SessionManager:
    """Opens, runs, and resumes sessions on one Engine (``engine.open_session`` / ``resume_session``)."""

    def __init__(self, engine: Any) -> None:
        # The Engine (not imported: the engine imports this module).
        self.engine = engine

    # -- opening -----------------------------------------------------------------------
    def _chunk_loop(self, instance: ModelInstance) -> ChunkRolloutLoop[Any]:
        loop_ids = [lid for lid, spec in instance.card.loops.items() if spec.kind == ChunkRolloutLoop.kind]
        if not loop_ids:
            raise InvalidRequest(
                "model", f"card {instance.model_id!r} has no chunk_rollout loop, so it cannot stream a session",
                allowed=sorted(m for m, i in self.engine.instances.items() if i.card.streams_sessions) or "none loaded",
            )
        loop = instance.loop(loop_ids[0])
        if not isinstance(loop, ChunkRolloutLoop):
            raise InvalidRequest("model", f"loop {loop_ids[0]!r} of {instance.model_id!r} is not a ChunkRolloutLoop")
        return loop

    def _request_for(self, session: SessionRequest) -> tuple[Request, ModelInstance]:
        instance = self.engine.instances.get(session.model)
        if instance is None:
            raise UnknownModel(session.model, self.engine.instances)
        request = Request(
            request_id=session.session_id, model=session.model, task=TaskType.TEXT_TO_VIDEO,
            inputs=(TextPart(text=session.prompt),),
            diffusion=DiffusionParams(height=session.height, width=session.width, fps=session.fps, seed=session.seed),
            output=self._output(session), priority="interactive",
        )
        return self.engine.validate(request), instance

    @staticmethod
    def _output(session: SessionRequest) -> OutputSpec:
        return OutputSpec(stream_previews=session.previews)

    def _reservation(self, instance: ModelInstance, request: Request, loop: ChunkRolloutLoop[Any]) -> Reservation:
        """The rollout loop's whole-life estimate, priced like a request's (pool slabs included)."""
        device = self.engine.scheduler.memory.device_of[instance.instance_id]
        return price_estimate(instance, request, loop.estimate(request, instance), self.engine.cost_model, device=device)

    def _enqueue(self, record: SessionRecord) -> SessionHandle:
        engine = self.engine
        if engine._scheduler_task is None or engine._loop is None:
            raise RuntimeError("the engine is not running: use 'async with engine.running():' or await engine.start()")
        if record.session_id in engine._records:
            raise InvalidRequest("session_id", f"session {record.session_id!r} already exists on this engine")
        loop = self._chunk_loop(record.instance)
        record.reservation = self._reservation(record.instance, record.request, loop)
        impossible = engine.admission.never_fits(record.reservation)
        if impossible is not None:
            engine.scheduler.count_rejection("capacity")
            raise CapacityError(f"session {record.session_id} {impossible}", param="model")
        engine.scheduler.queue.push(record)  # QueueFull, typed, when the queue is full
        engine._records[record.session_id] = record
        record.emit("request.queued")
        handle = SessionHandle(record, self)
        record.watchdog = asyncio.get_running_loop().create_task(self._watch_idle(record), name=f"fv-idle-{record.session_id}")
        engine._kick()
        return handle

    def open(self, session: SessionRequest) -> SessionHandle:
        """Admit ``session`` (queued until its reservation fits); must be called on the engine's loop."""
        request, instance = self._request_for(session)
        return self._enqueue(SessionRecord(request, instance, self.engine._loop, session))

    def resume(self, data: bytes) -> SessionHandle:
        """Continue a session from :meth:`SessionHandle.suspend`'s bytes (maybe in another process)."""
        try:
            payload = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:
            raise StateFormatError(f"not a suspended fv session: {exc}", param="state") from None
        if not isinstance(payload, dict) or payload.get("format") != SESSION_FORMAT:
            raise StateFormatError(f"not a suspended fv session (expected format {SESSION_FORMAT!r})", param="state")
        session = SessionRequest.of(**payload["session"])
        request, instance = self._request_for(session)
        state = self._chunk_loop(instance).state_type.from_bytes(payload["state"])
        if not isinstance(state, ChunkRolloutState) or state.request_id != session.session_id:
            raise StateFormatError("a suspended session's state is not its chunk rollout's", param="state")
        record = SessionRecord(request, instance, self.engine._loop, session, resume_state=state,
                               chunks_emitted=int(payload["chunks"]))
        return self._enqueue(record)

    # -- client operations -----------------------------------------------------------------
    def _client_error(self, record: SessionRecord, exc: FvError, event_id: str | None = None) -> FvError:
        """A client mistake on a live session: a ``session.error`` event (the session lives on), and the error to raise."""
        if not record.finished:
            record.emit("session.error", error=ErrorInfo(**exc.info()), event_id=event_id)
        return exc

    def push_text(self, record: SessionRecord, prompt: str, event_id: str | None) -> int:
        if record.ended:
            raise SessionClosed(record.session_id, record.close_reason or "ended", "a prompt update")
        if not isinstance(prompt, str) or not prompt.strip():
            raise self._client_error(record, InvalidRequest("prompt", "a prompt update must be a non-blank string"), event_id)
        if len(prompt) > MAX_PROMPT_CHARS:
            raise self._client_error(record, InvalidRequest(
                "prompt", f"a prompt update is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}"), event_id)
        version = record.next_version
        record.next_version += 1
        record.inbox.append((prompt, version))
        record.last_activity = time.monotonic()
        record.emit("session.prompt_queued", event_id=event_id, version=version)
        return version

    def cancel(self, record: SessionRecord, scope: str) -> None:
        try:
            checked = check_cancel_scope(scope)
        except InvalidRequest as exc:
            raise self._client_error(record, exc) from None
        if record.ended:
            raise SessionClosed(record.session_id, record.close_reason or "ended", f"cancel(scope={scope!r})")
        record.last_activity = time.monotonic()
        if checked == "stream":
            record.stream_cancel = True
            return
        self.end(record, "cancelled")

    def end(self, record: SessionRecord, reason: str) -> None:
        """End the session at the next step boundary (a queued one at once)."""
        if record.ended:
            return
        record.close_reason = reason
        self.engine.cancel(record.session_id, reason)

    async def suspend(self, record: SessionRecord) -> bytes:
        if record.ended:
            raise SessionClosed(record.session_id, record.close_reason or "ended", "suspend")
        if record.suspend_waiter is None:
            record.suspend_waiter = asyncio.get_running_loop().create_future()
        waiter = record.suspend_waiter
        done = asyncio.ensure_future(asyncio.shield(record.done))
        finished, _ = await asyncio.wait({waiter, done}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in finished:
            done.cancel()
            return waiter.result()
        raise SessionClosed(record.session_id, record.close_reason or "ended", "suspend")

    async def _watch_idle(self, record: SessionRecord) -> None:
        timeout = record.session.idle_timeout_s
        while not record.finished and not record.ended:
            left = record.last_activity + timeout - time.monotonic()
            if left <= 0:
                self.end(record, "idle_timeout")
                return
            try:
                await asyncio.wait_for(asyncio.shield(record.done), timeout=left)
            except asyncio.TimeoutError:
                continue
            return

    # -- running -----------------------------------------------------------------------------
    async def run(self, record: SessionRecord, program: Any) -> None:
        """The session's task, started by the engine's admission pass (``program`` is unused: a
        session runs its card's chunk_rollout loop alone)."""
        engine = self.engine
        instance, request = record.instance, record.request
        loop = self._chunk_loop(instance)
        ctx = LoopContext(
            request=request,
            executor=lambda plan: self._paced(record, plan),
            emit_event=record.emit,
            cancel=record.cancel,
            services=engine.services,
            hooks=engine.hooks_for(instance, request),
            upstream={SESSION_UPSTREAM: {"max_chunks": record.session.max_chunks}},
        )
        ctx.on_state = self._state_hook(record, loop, ctx)
        resumed = record.resume_state is not None
        try:
            await engine._loads.ensure(instance, request.task)
            defaults = request.diffusion
            record.emit("session.started", model=request.model, fps=defaults.fps, height=defaults.height,
                        width=defaults.width, max_chunks=record.session.max_chunks)
            if resumed:
                assert record.resume_state is not None
                record.emit("session.resumed", chunk_index=record.resume_state.chunk_index,
                            prompt_version=record.resume_state.prompt_version)
            await drive(loop, instance, ctx, state=record.resume_state)
        except (LoopCancelled, RequestCancelled):
            reason = record.close_reason or "cancelled"
            self._close(record, reason, None)
        except Exception as exc:  # isolate: one session's failure ends only it
            if isinstance(exc, FvError):
                info = ErrorInfo(**exc.info())
            else:
                log.exception("session %s failed", record.session_id, exc_info=exc)
                info = ErrorInfo(type="internal_error", message=f"{type(exc).__name__}: {exc}")
            self._close(record, "failed", info)
        else:
            self._close(record, "completed", None)
        finally:
            try:
                loop.release(record.session_id, instance)
            except Exception:  # a release failure must not take the engine down
                log.exception("releasing session %s's resources failed", record.session_id)
            if engine.hooks is not None:
                try:
                    engine.hooks.request_finished(record.session_id, record.status)
                except Exception:  # a plugin's listener must not fail the session
                    log.exception("fv_request_finished hook failed")
            if record.suspend_waiter is not None and not record.suspend_waiter.done():
                record.suspend_waiter.set_exception(
                    SessionClosed(record.session_id, self.close_reason(record), "suspend"))
                record.suspend_waiter.exception()  # retrieved: no "never retrieved" warning if nobody awaits it
            engine.scheduler.running.pop(record.session_id, None)
            engine._retire(record.session_id)
            for unit in engine.scheduler.pending.drop_request(record.session_id):
                if not unit.future.done():
                    unit.future.cancel()
            engine._free_slabs(record)  # whatever a loop's release left: admission gets the slabs back with the reservation
            engine.admission.release(record.session_id)
            engine._kick()

    async def _paced(self, record: SessionRecord, plan: Any) -> Any:
        """The engine's executor, after waiting while the session is ``max_ahead_chunks`` ahead of its listeners."""
        while record.chunks_ahead() > record.session.max_ahead_chunks and not record.cancel.cancelled:
            if record.suspend_waiter is not None and not record.suspend_waiter.done():
                break  # a suspend is taken at the next step boundary: let one step run
            await asyncio.sleep(_PACE_POLL_S)
        return await self.engine._enqueue(record, plan)

    @staticmethod
    def close_reason(record: SessionRecord) -> str:
        return record.close_reason or "ended"

    def _close(self, record: SessionRecord, reason: str, error: ErrorInfo | None) -> None:
        if record.stream_open and reason != "suspended":
            record.emit("media.complete", stream=VIDEO_STREAM)
        record.status = {"completed": "completed", "failed": "failed"}.get(reason, "cancelled")
        metrics = self.engine.metrics
        if record.status == "completed":
            metrics.completed += 1
        elif record.status == "failed":
            metrics.failed += 1
        else:
            metrics.cancelled += 1
        record.emit("session.closed", reason=reason, chunks=record.chunks_emitted, error=error)
        if not record.done.done():
            status = record.status if record.status in ("completed", "failed") else "cancelled"
            record.done.set_result(GenerationResult(record.session_id, status, error=error))  # type: ignore[arg-type]

    def _state_hook(self, record: SessionRecord, loop: ChunkRolloutLoop[Any], ctx: LoopContext) -> Callable[[Any], Any]:
        def on_state(state: ChunkRolloutState) -> ChunkRolloutState:
            return self._on_state(record, loop, ctx, state)

        return on_state

    def _emit_chunk(self, record: SessionRecord, state: ChunkRolloutState, chunk: ReadyChunk, frame_start: int) -> None:
        if not record.stream_open:
            record.emit("media.init", stream=VIDEO_STREAM, modality="video", fps=state.fps)
            record.stream_open = True
        fps = state.fps
        # A preview carries the index and frame range of the final chunk that replaces it.
        record.emit(
            "media.chunk", stream=VIDEO_STREAM, index=record.chunks_emitted, frames=chunk.frames.detach(),
            frame_start=frame_start, num_frames=chunk.num_frames, fps=fps,
            pts=(frame_start / fps, (frame_start + chunk.num_frames) / fps), preview=chunk.preview,
            prompt_version=chunk.prompt_version,
        )
        if not chunk.preview:
            record.chunks_emitted += 1

    def _on_state(
        self, record: SessionRecord, loop: ChunkRolloutLoop[Any], ctx: LoopContext, state: ChunkRolloutState
    ) -> ChunkRolloutState:
        """Between two steps: emit decoded chunks, apply client messages, suspend if asked."""
        start = state.frames_emitted
        state, chunks = loop.take_ready(state)
        for chunk in chunks:
            if chunk.preview and not record.session.previews:
                continue
            if record.session.stream:
                self._emit_chunk(record, state, chunk, start)
            if not chunk.preview:
                start += chunk.num_frames
        if state.prompt_version != record.applied_version:
            record.applied_version = state.prompt_version
            record.emit("session.prompt_applied", version=state.prompt_version, chunk_index=state.chunk_index)
        for prompt, version in record.inbox:
            state = loop.update_prompt(state, prompt, version)
        record.inbox.clear()
        if record.stream_cancel:
            record.stream_cancel = False
            state = loop.cancel_stream(state)
        record.state = state
        waiter = record.suspend_waiter
        if waiter is not None and not waiter.done() and not record.ended:
            data = self._suspend_bytes(record, loop.suspend(state, ctx))
            record.close_reason = "suspended"
            record.emit("session.suspended", chunk_index=state.chunk_index, nbytes=len(data))
            waiter.set_result(data)
            record.cancel.cancel("suspended")
        return state

    @staticmethod
    def _suspend_bytes(record: SessionRecord, state: ChunkRolloutState) -> bytes:
        buffer = io.BytesIO()
        torch.save({
            "format": SESSION_FORMAT, "session": record.session.model_dump(mode="json"),
            "state": state.to_bytes(), "chunks": record.chunks_emitted,
        }, buffer)
        return buffer.getvalue()
