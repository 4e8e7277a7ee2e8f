"""The driven-loop contract (design §5.1, §6.2).

A loop is a serializable state machine. The model describes its next step
(:meth:`Loop.next` returns a :class:`WorkPlan` and runs no kernels); the runtime
decides when and with whom that step runs (``await ctx.execute(plan)``); the model
folds the result back in (:meth:`Loop.advance`). All per-request state lives in a
typed :class:`LoopState`.
"""

from __future__ import annotations

import abc
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from fv_kernel.loop.state import TensorState
from fv_kernel.request.artifacts import Artifact

if TYPE_CHECKING:  # pragma: no cover - typing only
    from fv_kernel.card.instance import ModelInstance
    from fv_kernel.card.spec import LoopSpec
    from fv_kernel.loop.context import LoopContext
    from fv_kernel.request.request import Request

__all__ = [
    "WorkKind",
    "ShapeSignature",
    "StepEstimate",
    "ResourceRequest",
    "CacheRef",
    "CachePlan",
    "CancelScope",
    "EmitSpec",
    "WorkPlan",
    "StepResult",
    "Done",
    "LoopResult",
    "LoopState",
    "Loop",
]


class WorkKind(str, Enum):
    """The kinds of schedulable step (design §6.1). Tokens are one kind, not the scheduler."""

    DIFFUSION_STEP = "diffusion_step"
    DIFFUSION_WINDOW = "diffusion_window"
    CHUNK_STEP = "chunk_step"
    AR_PREFILL = "ar_prefill"
    AR_TOKEN = "ar_token"
    ENCODER_CHUNK = "encoder_chunk"
    VAE_TILE = "vae_tile"
    AUDIO_CHUNK = "audio_chunk"
    REWARD_BATCH = "reward_batch"
    LOGPROB_BATCH = "logprob_batch"
    TRANSFER = "transfer"
    CACHE_IO = "cache_io"
    GRAPH_CAPTURE = "graph_capture"


class ShapeSignature(BaseModel):
    """The shape facts of a step that decide batch compatibility and graph keys.

    Build one with ``ShapeSignature.of(tokens=4096, frames=21)``. Two plans batch
    together only if their signatures are equal.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dims: tuple[tuple[str, int | float | str], ...] = ()

    @classmethod
    def of(cls, **dims: int | float | str) -> "ShapeSignature":
        return cls(dims=tuple(sorted(dims.items())))

    def get(self, name: str, default: Any = None) -> Any:
        for key, value in self.dims:
            if key == name:
                return value
        return default

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.dims)


class StepEstimate(BaseModel):
    """``count`` steps a loop will run, described so the runtime can price them (design §6.1).

    The fields are those of the :class:`WorkPlan` s the loop will emit. The runtime prices
    them with the same calibrated cost key as executed steps (instance, kind, shape,
    precision) and the loop's ``StepCostSpec``, so what the Profiler learns from executed
    steps moves the next request's reservation.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    loop_id: str
    kind: WorkKind
    shape_sig: ShapeSignature = Field(default_factory=ShapeSignature)
    precision: str = "fp32"
    count: int = Field(default=1, ge=0)


class ResourceRequest(BaseModel):
    """What a step (or a loop's whole life) needs reserved before it may run (design §6.2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Predicted GPU-seconds, used as given (uncalibrated). On a WorkPlan, None lets the
    #: runtime's cost model price the step; a loop's whole-life estimate describes ``steps``
    #: instead and leaves this None.
    gpu_seconds: float | None = Field(default=None, ge=0)
    #: Bytes that stay allocated for the life of the request (latents, KV, state).
    resident_bytes: int = Field(default=0, ge=0)
    #: Worst-case transient activation bytes while the step runs.
    peak_bytes: int = Field(default=0, ge=0)
    #: Blocks of an unnamed cache, counted against ``scheduler.budgets.cache_blocks``.
    cache_blocks: int = Field(default=0, ge=0)
    #: Blocks per named block pool of the instance (``ModelInstance.block_pools()``), reserved
    #: against that pool's real capacity.
    pool_blocks: dict[str, NonNegativeInt] = Field(default_factory=dict)
    #: The steps a whole-life estimate covers; the runtime prices them with its cost model.
    steps: tuple[StepEstimate, ...] = ()


class CacheRef(BaseModel):
    """One entry of a named cache service. For writes, ``output``/``index`` pick the slice
    of the step's outputs to store (``outputs[output][index:index+1]``; all outputs if None)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache: str
    key: str
    output: str | None = None
    index: int | None = None


class CachePlan(BaseModel):
    """Typed cache reads and writes of a step (design §7.1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reads: tuple[CacheRef, ...] = ()
    writes: tuple[CacheRef, ...] = ()


class CancelScope(str, Enum):
    """What cancelling the request does to a planned step (design §12).

    ``REQUEST`` (the default): the step is abandoned if it has not started; its queued
    unit is dropped and the request ends at this step boundary. ``NONE``: once planned,
    the step runs to completion (e.g. a cache write that must land); cancellation takes
    effect at the next step boundary after it ran. Loop-, stream- and session-scoped
    cancellation are not built yet.
    """

    REQUEST = "request"
    NONE = "none"


class EmitSpec(BaseModel):
    """A stream chunk the driver emits after the step ran.

    Either it names a step output (``from_output``: the driver streams that tensor,
    e.g. decoded frames as a preview) or it carries ``text`` directly. The first chunk
    of a stream is preceded by ``media.init``; ``media.complete`` follows when the loop
    that opened the stream finishes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stream: str
    modality: Literal["video", "audio", "text"]
    #: A preview chunk is emitted only for requests with ``output.stream_previews``.
    preview: bool = False
    from_output: str | None = None
    text: str | None = None
    pts: tuple[float, float] = (0.0, 0.0)
    #: The stream's frame rate, for its ``media.init`` (default: the request's fps for video).
    fps: float | None = Field(default=None, gt=0)
    #: The stream's sample rate in Hz, for its ``media.init`` (audio).
    sample_rate: int | None = Field(default=None, gt=0)


class WorkPlan(BaseModel):
    """One step, described: what to run, on what, at what price. Building it runs no kernels.

    ``op`` names an executable step of the model instance; ``inputs`` are this
    request's tensors with the batch on dim 0; ``params`` are the non-tensor
    arguments, which must be equal for two plans to batch together. Per-request
    scalars that differ between requests at different points of their loops (the
    timestep, the sigma) belong in ``inputs`` as one value per row, never in
    ``params``: steps of requests at different step indices then still batch.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    loop_id: str
    instance_id: str
    kind: WorkKind
    op: str
    inputs: dict[str, torch.Tensor] = Field(default_factory=dict)
    params: dict[str, Any] = Field(default_factory=dict)
    # Factories, not model defaults: pydantic deep-copies a model default for every plan (12 µs
    # each on every step; constructing one is 1.5 µs).
    shape_sig: ShapeSignature = Field(default_factory=ShapeSignature)
    precision: str = "fp32"
    #: Extra key for compiled-graph reuse (backend, compile tier, ...).
    graph_key: str = ""
    resources: ResourceRequest = Field(default_factory=ResourceRequest)
    cache: CachePlan = Field(default_factory=CachePlan)
    #: What cancelling the request does to this step once planned (see :class:`CancelScope`).
    cancel_scope: CancelScope = CancelScope.REQUEST
    emits: list[EmitSpec] = Field(default_factory=list)
    #: False keeps the step batch-of-1 by policy (e.g. a jumbo video step).
    batchable: bool = True
    #: Which guidance branch / sub-step this is, for observers (e.g. "cond").
    tag: str = ""
    #: The loop step this plan is (stamped by the driver from ``LoopState.step`` when left
    #: None). Per request, so it is not part of :meth:`batch_key`.
    step_index: int | None = Field(default=None, ge=0)

    def batch_key(self) -> tuple[Any, ...]:
        """Plans with equal keys can run as one batched execution."""
        return (
            self.instance_id,
            self.kind.value,
            self.op,
            self.shape_sig,
            self.precision,
            self.graph_key,
            _freeze(self.params),
        )


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


class StepResult(BaseModel):
    """What one executed step returns to its loop."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    outputs: dict[str, torch.Tensor] = Field(default_factory=dict)
    wall_seconds: float = 0.0
    #: How many requests shared the batched execution that produced this result.
    batch_size: int = 1


class Done(BaseModel):
    """Returned by :meth:`Loop.next` when the loop has no more steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str = "complete"


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

    def __init__(self, spec: "LoopSpec") -> None:
        self.spec = spec
        self.loop_id = spec.loop_id

    @abc.abstractmethod
    def init(self, request: "Request", model: "ModelInstance", ctx: "LoopContext") -> S:
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

    def bind(self, instance: "ModelInstance") -> None:
        """Attach per-instance resources (a tokenizer, a pool) when ``instance`` builds this loop.

        :meth:`ModelInstance.loop` calls it once, before the loop serves any request. A
        loop may keep what it binds here (it is the instance's, shared by every request);
        it never keeps anything it learns in ``init``. The default binds nothing.
        """

    def restore(self, state: S, model: "ModelInstance", ctx: "LoopContext") -> S:
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

    def estimate(self, request: "Request", model: "ModelInstance") -> ResourceRequest:
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
