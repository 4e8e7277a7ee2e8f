"""The typed records a step crosses the runtime with (design §6.1, §6.2).

A loop describes its next step as a :class:`WorkPlan`; the runtime prices it
(:class:`ResourceRequest`, :class:`StepEstimate`), batches plans with equal
:meth:`WorkPlan.batch_key`, runs the instance's :class:`StepOp` and hands back a
:class:`StepResult`. Nothing here knows a loop, an instance or a scheduler: these are
the records those layers share.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

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
    "StepOp",
    "TensorDict",
]

TensorDict = dict[str, torch.Tensor]


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

    One dimension has a meaning of its own: ``repeat``, the number of sub-steps of this shape
    one step runs back to back (a decode step that samples ``repeat`` tokens in a row, each
    from the last: multi-step decode). The cost model prices such a step ``repeat`` times one.
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

    @property
    def repeat(self) -> int:
        """Sub-steps of this shape the step runs back to back (the ``repeat`` dim; 1 when absent)."""
        return int(self.get("repeat", 1))

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


@dataclass(frozen=True)
class StepOp:
    """An executable step of a model instance: what a :class:`WorkPlan`'s ``op`` names.

    ``fn(inputs, params) -> outputs`` takes a batch on dim 0 of every input tensor
    and returns outputs with the same batch on dim 0. ``batch_invariant`` says a
    fused batch gives bit-identical per-sample results; when it does not, the
    runtime's exact mode runs requests of one batch through ``fn`` one by one
    (see ``docs/architecture.md``, batch invariance). Outputs may be host tensors
    still being copied from the device (``non_blocking``): both runtimes wait for the
    device before any output is read (the Engine on each batch's end event, ``run_local``
    in :func:`~fv_kernel.runtime.local.wait_for_host_outputs`).
    """

    name: str
    fn: Callable[[TensorDict, Mapping[str, Any]], TensorDict]
    batch_invariant: bool = False
    #: The op runs a block sequence and honours ``params["block_hooks"]`` (block interceptors/observers).
    supports_block_hooks: bool = False

    def run_fused(self, batch: Sequence[TensorDict], params: Mapping[str, Any]) -> list[TensorDict]:
        if len(batch) == 1:
            return [self.fn(batch[0], params)]
        names = list(batch[0])
        sizes = [next(iter(item.values())).shape[0] if item else 1 for item in batch]
        joined = {name: torch.cat([item[name] for item in batch], dim=0) for name in names}
        out = self.fn(joined, params)
        pieces: list[TensorDict] = [{} for _ in batch]
        for name, tensor in out.items():
            for index, chunk in enumerate(torch.split(tensor, sizes, dim=0)):
                pieces[index][name] = chunk
        return pieces

    def run_per_sample(self, batch: Sequence[TensorDict], params: Mapping[str, Any]) -> list[TensorDict]:
        return [self.fn(item, params) for item in batch]
