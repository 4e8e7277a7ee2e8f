"""What the engine keeps per request, and what a caller holds of it.

:class:`RequestRecord` is the engine's record of one request (its ordered events and their
subscribers, the future of its result, its reservation, its program run);
:class:`RequestHandle` is the caller's view of it; :class:`GenerationResult` is how it ended.
"""

from __future__ import annotations

import asyncio
import time
import typing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Literal

import torch
from pydantic import BaseModel

from fv_kernel.errors import StepFailed
from fv_kernel.loop.contract import CancelToken
from fv_kernel.model.instance import ModelInstance
from fv_kernel.program.resume import ProgramRun
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.events import TERMINAL_EVENT_TYPES, ErrorInfo, Event
from fv_kernel.request.request import Request
from fv_kernel.runtime.admission import Reservation

__all__ = ["EVENT_CLASSES", "GenerationResult", "RecordStore", "RequestRecord", "RequestHandle", "held_tensor_bytes"]

#: Event classes by their ``type`` (what ``RequestRecord.emit`` and a loop's ``ctx.emit`` name).
EVENT_CLASSES: dict[str, type] = {
    cls.model_fields["type"].default: cls for cls in typing.get_args(typing.get_args(Event)[0])
}


@dataclass
class GenerationResult:
    request_id: str
    status: Literal["completed", "failed", "cancelled"]
    artifacts: list[Artifact] = field(default_factory=list)
    error: ErrorInfo | None = None

    def artifact(self, kind: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.kind == kind), None)

    def raise_for_status(self) -> "GenerationResult":
        if self.status != "completed":
            detail = self.error.message if self.error else self.status
            raise StepFailed(f"request {self.request_id} {self.status}: {detail}")
        return self


class RequestRecord:
    """Everything the engine tracks for one request: its events, subscribers, result and reservation."""

    def __init__(self, request: Request, instance: ModelInstance, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.instance = instance
        self.cancel = CancelToken()
        self.events: list[Event] = []
        self.subscribers: list[asyncio.Queue[Event]] = []
        self.done: asyncio.Future[GenerationResult] = loop.create_future()
        self.task: asyncio.Task[None] | None = None
        self.status: str = "queued"
        #: When the request was submitted (``time.monotonic()``): how long a batch-class request has waited.
        self.queued_at = time.monotonic()
        self.steps_done = 0
        #: The request's way through its program, when it resumes a checkpoint or reports steps.
        self.program_run: ProgramRun | None = None
        #: Priced once, when the request first reaches the head of its queue.
        self.reservation: Reservation | None = None

    def emit(self, event_type: str, **fields: Any) -> None:
        event_cls = EVENT_CLASSES.get(event_type)
        if event_cls is None:
            raise ValueError(f"unknown event type {event_type!r}; allowed: {sorted(EVENT_CLASSES)}")
        event = event_cls(request_id=self.request.request_id, seq=len(self.events), **fields)
        self.events.append(event)
        for queue in self.subscribers:
            queue.put_nowait(event)

    @property
    def finished(self) -> bool:
        return self.done.done()


def held_tensor_bytes(*objects: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``objects`` (models, lists, dicts)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = list(objects)
    visited: set[int] = set()
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, BaseModel):
            if id(obj) not in visited:
                visited.add(id(obj))
                stack.extend(obj.__dict__.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
    return total


class RequestHandle:
    """The caller's view of a submitted request."""

    def __init__(self, record: RequestRecord, cancel: Callable[[str, str], Any]) -> None:
        self._record = record
        self._cancel = cancel

    @property
    def request_id(self) -> str:
        return self._record.request.request_id

    @property
    def status(self) -> str:
        return self._record.status

    @property
    def progress(self) -> float:
        for event in reversed(self._record.events):
            if event.type == "progress" and event.total:
                return min(event.step / event.total, 1.0)
        return 1.0 if self._record.status == "completed" else 0.0

    async def events(self) -> AsyncIterator[Event]:
        """Every event of the request in order, from the first, until the terminal one."""
        record = self._record
        queue: asyncio.Queue[Event] = asyncio.Queue()
        history = list(record.events)
        record.subscribers.append(queue)
        try:
            for event in history:
                yield event
                if event.type in TERMINAL_EVENT_TYPES:
                    return
            if history and history[-1].type in TERMINAL_EVENT_TYPES:
                return
            while True:
                event = await queue.get()
                if event.seq < len(history):
                    continue
                yield event
                if event.type in TERMINAL_EVENT_TYPES:
                    return
        finally:
            record.subscribers.remove(queue)

    async def result(self) -> GenerationResult:
        return await asyncio.shield(self._record.done)

    def cancel(self, reason: str = "cancelled by caller") -> None:
        self._cancel(self.request_id, reason)


class RecordStore:
    """The engine's request records by id. Finished ones are kept for late subscribers, the oldest
    forgotten first beyond ``keep`` records or ``keep_bytes`` of tensors, so a long-running server
    does not grow."""

    def __init__(self, *, keep: int, keep_bytes: int) -> None:
        self.records: dict[str, RequestRecord] = {}
        self._keep, self._keep_bytes = keep, keep_bytes
        #: Finished requests still recorded, oldest first, with the tensor bytes each holds.
        self._finished: dict[str, int] = {}
        self._finished_bytes = 0

    def retire(self, request_id: str) -> None:
        """Note a finished request; forget the oldest finished ones beyond the bounds."""
        record = self.records.get(request_id)
        if record is None or request_id in self._finished:
            return
        held = held_tensor_bytes(record.request, record.events)
        self._finished[request_id] = held
        self._finished_bytes += held
        while self._finished and (len(self._finished) > self._keep or self._finished_bytes > self._keep_bytes):
            self.forget(next(iter(self._finished)))

    def forget(self, request_id: str) -> bool:
        """Drop a finished request's record; False if it is unknown or still running."""
        record = self.records.get(request_id)
        if record is None or not record.finished:
            return False
        del self.records[request_id]
        self._finished_bytes -= self._finished.pop(request_id, 0)
        return True

    def retained(self) -> tuple[int, int]:
        """Finished requests still recorded, and the tensor bytes they hold."""
        return len(self._finished), self._finished_bytes
