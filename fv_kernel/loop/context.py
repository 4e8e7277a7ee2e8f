"""What a running loop sees of the runtime: ``await ctx.execute(plan)`` and ``ctx.emit(...)``.

The context is per request. The runtime supplies the executor (the scheduler, or a
direct local executor), the event sink and the cancel token; loops never see which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from fv_kernel.errors import RequestCancelled
from fv_kernel.loop.contract import StepResult, WorkPlan

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.card.instance import ModelInstance
    from fv_kernel.extend.hooks import RequestHooks
    from fv_kernel.request.request import Request

__all__ = ["CancelToken", "LoopContext", "Executor", "EventSink"]

Executor = Callable[[WorkPlan], Awaitable[StepResult]]
#: ``sink(event_class_name, **fields)``: the runtime stamps request id and sequence number.
EventSink = Callable[..., None]


class CancelToken:
    """Cancellation flag checked by the driver at every step boundary."""

    def __init__(self) -> None:
        self._reason: str | None = None

    def cancel(self, reason: str = "cancelled by caller") -> None:
        if self._reason is None:
            self._reason = reason

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    def raise_if_cancelled(self) -> None:
        if self._reason is not None:
            raise RequestCancelled(self._reason)


@dataclass
class LoopContext:
    """Per-request runtime services handed to a loop and its driver."""

    request: "Request"
    executor: Executor
    emit_event: EventSink = field(default=lambda *a, **k: None)
    cancel: CancelToken = field(default_factory=CancelToken)
    #: Outputs of the loops that ran before this one in the request's program.
    upstream: dict[str, Any] = field(default_factory=dict)
    #: Shared services (feature cache, KV pools, ...) keyed by name; resolved by the runtime.
    services: dict[str, Any] = field(default_factory=dict)
    #: Called with each new LoopState after a step (checkpointing). It may return a
    #: replacement state (e.g. one restored from bytes), which the driver continues from.
    on_state: Callable[[Any], Any] | None = None
    #: The extensions active for this request (None: nothing to hook, nothing on the hot path).
    hooks: "RequestHooks | None" = None
    #: The instance the current loop runs on (set by the driver).
    instance: "ModelInstance | None" = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def execute(self, plan: WorkPlan) -> StepResult:
        """The inversion point: the runtime admits, batches, places and runs the step."""
        return await self.executor(plan)

    def emit(self, event_type: str, **fields: Any) -> None:
        self.emit_event(event_type, **fields)

    def child(self, upstream: dict[str, Any]) -> "LoopContext":
        """The context of the next loop in a program: same request and runtime, new upstream."""
        return LoopContext(
            request=self.request, executor=self.executor, emit_event=self.emit_event, cancel=self.cancel,
            upstream=upstream, services=self.services, on_state=self.on_state, hooks=self.hooks,
            instance=self.instance,
        )
