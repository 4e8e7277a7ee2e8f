"""The driven-loop contract (design §5.1, §6.2).

A loop is a serializable state machine. The model describes its next step
(:meth:`Loop.next` returns a :class:`~fv_kernel.loop.plan.WorkPlan` and runs no kernels);
the runtime decides when and with whom that step runs (``await ctx.execute(plan)``); the
model folds the result back in (:meth:`Loop.advance`). All per-request state lives in a
typed :class:`LoopState`.

The loop layer sees the layers above it only through the two protocols defined here:
:class:`ResidentModel` (the instance a loop runs on; ``fv_kernel.model.ModelInstance``
implements it) and :class:`StepHooks` (a request's extensions; ``fv_kernel.extend``'s
``RequestHooks`` implements it). The runtime hands both in through :class:`LoopContext`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Generic, Mapping, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fv_kernel.card.spec import LoopSpec, ModelCard
from fv_kernel.errors import RequestCancelled
from fv_kernel.loop.plan import EmitSpec, ResourceRequest, StepOp, StepResult, WorkPlan
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.request import Request
from fv_kernel.state import TensorState

if TYPE_CHECKING:  # pragma: no cover - typing only
    from fv_kernel.loop.samplers import Sampler

__all__ = [
    "Done",
    "LoopResult",
    "LoopState",
    "Loop",
    "LoopContext",
    "CancelToken",
    "Executor",
    "EventSink",
    "ResidentModel",
    "SamplerNames",
    "StepHooks",
]


class Done(BaseModel):
    """Returned by :meth:`Loop.next` when the loop has no more steps.

    ``emits``: text chunks the driver emits before ``finalize`` (what the last step produced
    that no later plan will carry, e.g. a decode loop's last tokens). A chunk that names a
    step output has no step to read it from here, and is refused.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str = "complete"
    emits: tuple[EmitSpec, ...] = ()

    @field_validator("emits")
    @classmethod
    def _text_only(cls, value: tuple[EmitSpec, ...]) -> tuple[EmitSpec, ...]:
        for emit in value:
            if emit.text is None:
                raise ValueError(f"a Done's emits carry text only; stream {emit.stream!r} names no text "
                                 f"(from_output={emit.from_output!r} has no step to read it from)")
        return value


class LoopResult(BaseModel):
    """The outcome of a finished loop: named tensors for the next loop, and artifacts."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    loop_id: str
    outputs: dict[str, Any] = Field(default_factory=dict)
    artifacts: list[Artifact] = Field(default_factory=list)


class LoopState(TensorState):
    """Base of every loop's typed state. Subclasses add their own typed fields."""

    request_id: str
    loop_id: str
    instance_id: str
    step: int = 0
    #: Interceptor state: ``plugin_state[plugin_id][branch]``, e.g. a block cache's residuals
    #: for the "cond" branch. Lives here so it is per request by construction.
    plugin_state: dict[str, dict[str, Any]] = Field(default_factory=dict)


Executor = Callable[[WorkPlan], Awaitable[StepResult]]
#: ``sink(event_class_name, **fields)``: the runtime stamps request id and sequence number.
EventSink = Callable[..., None]


class SamplerNames(Protocol):
    """The deployment's samplers, as the driver resolves names through them (a ``DeployRegistry``)."""

    @property
    def samplers(self) -> Mapping[str, type["Sampler"]]: ...


class ResidentModel(Protocol):
    """The resident instance a loop runs on, as the loop and program layers see it.

    ``fv_kernel.model.ModelInstance`` implements it; a family's loops may annotate their
    ``model`` argument with that class (or their own subclass of it) to reach components.
    """

    @property
    def card(self) -> ModelCard: ...

    @property
    def instance_id(self) -> str: ...

    @property
    def model_id(self) -> str: ...

    @property
    def weights_version(self) -> str: ...

    @property
    def registry(self) -> SamplerNames: ...

    def op(self, name: str) -> StepOp: ...

    def loop(self, loop_id: str) -> "Loop[Any]": ...


class StepHooks(Protocol):
    """A request's active extensions, as the driver uses them (``fv_kernel.extend``'s ``RequestHooks``)."""

    def attach(self, plan: WorkPlan, state: "LoopState", *, supports_block_hooks: bool, num_steps: int | None) -> WorkPlan:
        """The plan with the request's block hooks attached (when its op supports them)."""
        ...

    async def execute(self, plan: WorkPlan, state: "LoopState", execute: Executor) -> StepResult:
        """Run ``plan`` through the request's step interceptors, then ``execute``."""
        ...


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
    """Per-request runtime services handed to a loop and its driver.

    The runtime supplies the executor (the scheduler, or a direct local executor), the
    event sink and the cancel token; loops never see which.
    """

    request: Request
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
    hooks: StepHooks | None = None
    #: The instance the current loop runs on (set by the driver).
    instance: ResidentModel | None = None

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


S = TypeVar("S", bound=LoopState)


class Loop(abc.ABC, Generic[S]):
    """A model-owned loop. The runtime drives it; it never drives itself.

    A loop object is built from its card's :class:`~fv_kernel.card.spec.LoopSpec` and
    holds no per-request state: everything that changes between steps, including the
    id of the instance it runs on, lives in its ``state_type``.
    """

    #: The loop kind (e.g. "diffusion_denoise", "ar_decode"), from the card's LoopSpec.
    kind: ClassVar[str]
    state_type: ClassVar[type[LoopState]]
    #: Whether the loop honours ``OutputSpec.capture_behavior`` (:meth:`behavior_slice`, a
    #: ``BehaviorRecord`` from ``finalize``). The driver refuses a capture request on a denoise
    #: loop that does not, rather than return no record.
    captures_behavior: ClassVar[bool] = False

    def __init__(self, spec: LoopSpec) -> None:
        self.spec = spec
        self.loop_id = spec.loop_id

    @abc.abstractmethod
    def init(self, request: Request, model: ResidentModel, ctx: LoopContext) -> S:
        """Build the initial state. May run cheap CPU work (noise, sigmas), never a model step.

        ``ctx.upstream`` holds the outputs of the loops that ran before this one in
        the request's program (e.g. prompt embeddings for a denoise loop).
        """

    @abc.abstractmethod
    def next(self, state: S) -> WorkPlan | Done:
        """Describe the next step, or return :class:`Done`. Runs no kernels."""

    @abc.abstractmethod
    def advance(self, state: S, result: StepResult) -> S:
        """Fold a step's result into the state and return the new state."""

    @abc.abstractmethod
    def finalize(self, state: S) -> LoopResult:
        """Turn the final state into outputs and artifacts."""

    def check_request(self, request: Request, model: ResidentModel) -> None:
        """Refuse, before admission, a request this loop can never run: raise a typed error naming the field.

        Validation (``Engine.validate``, so every request and session) calls it on the loops of the
        request's program, after the request is resolved against its card: a loop whose recipe fixes
        what the card's generic checks cannot see (a distilled sampler's steps, a frame size its
        cache is sized for) says so here rather than failing in ``init`` after admission. Runs no
        kernels; the default accepts everything.
        """

    def bind(self, instance: ResidentModel) -> None:
        """Attach per-instance resources (a tokenizer, a pool) when ``instance`` builds this loop.

        :meth:`ModelInstance.loop` calls it once, before the loop serves any request. A
        loop may keep what it binds here (it is the instance's, shared by every request);
        it never keeps anything it learns in ``init``. The default binds nothing.
        """

    def restore(self, state: S, model: ResidentModel, ctx: LoopContext) -> S:
        """Re-attach what lives outside ``state`` after it was read back from bytes, maybe in another process.

        The driver calls it instead of :meth:`init` when a loop resumes from a saved
        state (``drive(loop, model, ctx, state=...)``). A loop whose state holds
        everything it needs (the common case) returns it unchanged, the default. A loop
        with per-process resources (e.g. K/V blocks in the instance's paged pool)
        re-acquires them here and returns the state that points at them; it runs no
        kernels here, but may return a state whose next steps rebuild what was lost.
        """
        return state

    def behavior_slice(self, state: S) -> Any:
        """The captured slice of the step that produced ``state`` (a ``BehaviorSlice``), or None.

        Called by the driver after each ``advance`` of a request with ``capture_behavior``;
        the driver streams it as a ``behavior.slice`` event.
        """
        return None

    def progress(self, state: S) -> tuple[int, int | None]:
        """(steps done, total steps or None) for progress events."""
        return state.step, None

    def partial(self, state: S) -> LoopResult | None:
        """Outputs worth returning when the loop is cancelled mid-way (None if nothing meaningful)."""
        return None

    def estimate(self, request: Request, model: ResidentModel) -> ResourceRequest:
        """Whole-life resources of this loop for ``request``: reserved at admission.

        ``steps`` describes every step the loop will run (kind, shape signature,
        precision, count: the same values its WorkPlans will carry), and the runtime
        prices them with its calibrated cost model; ``resident_bytes`` is what the loop
        keeps allocated, ``peak_bytes`` its largest transient, ``pool_blocks`` the blocks
        it takes from the instance's block pools. Estimates read the card's real
        dimensions and must not load weights. The default reserves nothing, which is
        right only for loops with negligible footprint.
        """
        return ResourceRequest()
