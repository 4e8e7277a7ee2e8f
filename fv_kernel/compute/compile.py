"""Compile tiers: per-block ``torch.compile``, CUDA-graph capture of whole steps, and their cache.

Every tier is optional and eager is always available and correct:

- ``compile="blocks"``: each transformer block is compiled in place (``Module.compile``),
  so the state dict keeps its keys and identical blocks share one compiled graph (one
  block's compile time, not the model's).
- ``cuda_graphs=True``: a whole step (one DiT forward) is captured once per shape
  bucket and replayed; the batch is padded up to the next bucket so a handful of
  graphs serve every batch size the scheduler fuses.
- :class:`CompileCache` holds what was built, keyed by :class:`CompileKey` (model,
  component, loop, kind, shape signature, precision, parallel plan, attention backend
  and tier), so nothing is compiled or captured twice and two different backends never
  share an artefact. ``CompileKey.digest()`` is the ``WorkPlan.graph_key`` a loop sets
  so the batch scheduler never fuses steps that would need different graphs.
- :func:`select_compute_tiers` applies each fast tier's parity contract
  (``fv_kernel.card.spec.TIER_PARITY_CONTRACTS``) to the measurements recorded in
  ``ComputeOptions.parity_record``, per component (the DiT apart from the VAE): a tier the
  options leave to fv (``fused_ops="auto"``) is selected for a component only when its recorded
  measurement on that component passes; a tier asked for by name still runs, with a warning
  naming why its contract is not met.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    # Imported where used: fv_kernel.card's package imports this module.
    from fv_kernel.card.spec import ModelCard, TierParityRecord, TierVerdict

__all__ = [
    "ComputeOptions",
    "FusedOpsMode",
    "ParityRecordError",
    "TierSelection",
    "load_parity_record",
    "select_compute_tiers",
    "CompileKey",
    "CompileCache",
    "CompileStats",
    "compile_blocks",
    "CapturedStep",
    "GraphedStep",
    "bucket_for",
]

T = TypeVar("T")
TensorDict = dict[str, torch.Tensor]
CompileTier = Literal["eager", "fused", "blocks", "blocks+graphs", "graphs", "fused+graphs"]
#: "off": the model's eager code; "auto": Triton kernels on CUDA when importable (and, with a parity
#: record, when the fused tier's contract passes for the component); "torch": the reference
#: implementation of the fused ops; "triton": Triton kernels or an error.
FusedOpsMode = Literal["off", "auto", "torch", "triton"]
#: The components whose fused ops are chosen apart (``fv_kernel.card.spec.TierComponent``).
_FUSED_COMPONENTS = ("dit", "vae")


class ComputeOptions(BaseModel):
    """How an instance runs its denoiser, beyond the attention backend (which ``InstanceOptions`` names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Every component's fused ops (``FusedOpsMode``), unless ``dit_fused_ops`` / ``vae_fused_ops`` set its own.
    fused_ops: FusedOpsMode = "off"
    #: The denoiser's fused ops in place of ``fused_ops`` (None: ``fused_ops``).
    dit_fused_ops: FusedOpsMode | None = None
    #: The VAE decoder's, likewise: ``vae_fused_ops="off"`` keeps the VAE eager while the DiT runs Triton.
    vae_fused_ops: FusedOpsMode | None = None
    #: "blocks": ``torch.compile`` each transformer block in place.
    compile: Literal["eager", "blocks"] = "eager"
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = "default"
    #: Capture each denoise forward as a CUDA graph per batch bucket (CUDA only; eager elsewhere).
    cuda_graphs: bool = False
    graph_batch_buckets: tuple[PositiveInt, ...] = Field(default=(1, 2, 4, 8, 16, 32))
    #: Tokens an autoregressive decode loop that samples on the device (a graphed decode) runs per
    #: scheduled step, each sampled token fed to the next sub-step on the device (multi-step decode,
    #: as vLLM's ``num_scheduler_steps``): the host's work per step is paid once per this many
    #: tokens. The tokens are those of one-token steps; cancellation and streamed text land at
    #: these boundaries. 1 schedules every token.
    decode_tokens_per_step: int = Field(default=8, ge=1, le=64)
    #: A JSON ``TierParityRecord`` (``bench/bench_tier_parity.py --record``): the trajectory
    #: measurements :func:`select_compute_tiers` judges each tier's contract on. None: nothing
    #: measured, so no fast tier is selected by default (``fused_ops="auto"`` stays eager).
    parity_record: Path | None = None

    @field_validator("graph_batch_buckets")
    @classmethod
    def _sorted_unique(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or list(value) != sorted(set(value)):
            raise ValueError(f"graph_batch_buckets must be non-empty, strictly increasing; got {value}")
        return value

    def fused_ops_for(self, component: str) -> FusedOpsMode:
        """The fused-ops mode of ``component`` (``dit`` or ``vae``)."""
        if component not in _FUSED_COMPONENTS:
            raise ValueError(f"component must be one of {list(_FUSED_COMPONENTS)}; got {component!r}")
        own = self.dit_fused_ops if component == "dit" else self.vae_fused_ops
        return self.fused_ops if own is None else own

    @property
    def tier(self) -> CompileTier:
        """The DiT's tier (the VAE's is its fused ops alone: :meth:`fused_ops_for`)."""
        fused = self.fused_ops_for("dit") != "off"
        base = "blocks" if self.compile == "blocks" else "fused" if fused else "eager"
        if not self.cuda_graphs:
            return base  # type: ignore[return-value]
        return "graphs" if base == "eager" else f"{base}+graphs"  # type: ignore[return-value]


class CompileKey(BaseModel):
    """Everything a compiled or captured artefact depends on; two different keys never share one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    component: str
    loop: str = ""
    kind: str = ""
    #: ``ShapeSignature.dims`` style ``(name, value)`` pairs; include every shape the graph fixes.
    shape_signature: tuple[tuple[str, int | float | str], ...] = ()
    precision: str
    parallel_plan: str = "single"
    backend: str
    tier: str

    def with_shapes(self, **dims: int | float | str) -> "CompileKey":
        """This key for another shape (e.g. a batch bucket), keeping every other field."""
        merged = dict(self.shape_signature)
        merged.update(dims)
        return self.model_copy(update={"shape_signature": tuple(sorted(merged.items()))})

    def digest(self) -> str:
        """A short stable hash, usable as ``WorkPlan.graph_key``."""
        payload = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    build_seconds: float = 0.0
    evictions: int = 0


class CompileCache:
    """Built artefacts (compiled callables, captured graphs) by :class:`CompileKey`, least-recently-used out.

    Building is timed (``stats.build_seconds``; per key in :meth:`build_seconds`). A
    failed build stores nothing and re-raises, so the caller can fall back to eager.
    """

    def __init__(self, max_entries: int = 64) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.stats = CompileStats()
        self._entries: OrderedDict[CompileKey, Any] = OrderedDict()
        self._build_seconds: dict[CompileKey, float] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[CompileKey]:
        return list(self._entries)

    def build_seconds(self, key: CompileKey) -> float | None:
        return self._build_seconds.get(key)

    def get_or_build(self, key: CompileKey, build: Callable[[], T]) -> T:
        if not isinstance(key, CompileKey):
            raise TypeError(f"key must be a CompileKey, got {type(key).__name__}")
        if key in self._entries:
            self.stats.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]  # type: ignore[no-any-return]
        self.stats.misses += 1
        started = time.perf_counter()
        value = build()
        elapsed = time.perf_counter() - started
        self.stats.build_seconds += elapsed
        self._build_seconds[key] = elapsed
        self._entries[key] = value
        while len(self._entries) > self.max_entries:
            old, _ = self._entries.popitem(last=False)
            self._build_seconds.pop(old, None)
            self.stats.evictions += 1
        return value

    def clear(self) -> None:
        self._entries.clear()
        self._build_seconds.clear()


def compile_blocks(
    blocks: nn.ModuleList,
    *,
    mode: str = "default",
    dynamic: bool | None = False,
    fullgraph: bool = False,
    backend: str = "inductor",
) -> int:
    """``torch.compile`` every block in place (keys unchanged); returns how many were wrapped.

    Compilation itself happens on each block's first call. Identical blocks reuse one
    graph because module parameters are graph inputs (``inline_inbuilt_nn_modules``).
    """
    options: dict[str, Any] = {"dynamic": dynamic, "fullgraph": fullgraph, "backend": backend}
    if mode != "default":
        options["mode"] = mode
    for block in blocks:
        block.compile(**options)
    return len(blocks)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= ``batch``, or None when the batch is larger than every bucket."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return next((b for b in buckets if b >= batch), None)


class CapturedStep:
    """One CUDA graph of ``fn(inputs) -> outputs`` at the shapes of ``example``.

    Inputs are copied into the graph's static buffers on every call and outputs are
    cloned out, so callers may keep what they get across replays.
    """

    def __init__(
        self,
        fn: Callable[[TensorDict], TensorDict],
        example: TensorDict,
        *,
        warmup: int = 2,
        pool: Any = None,
    ) -> None:
        if not example or any(t.device.type != "cuda" for t in example.values()):
            raise ValueError("CUDA-graph capture needs every example input on a CUDA device")
        self._static = {name: t.clone() for name, t in example.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream: lazy inits, autotuning, handles
            for _ in range(warmup):
                fn(self._static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's unsafe calls break the capture; another device lane's thread
        # (``SchedulerConfig.overlap_kinds``) or the event loop's may allocate meanwhile.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self._outputs = fn(self._static)

    @property
    def pool(self) -> Any:
        return self.graph.pool()

    def __call__(self, inputs: TensorDict) -> TensorDict:
        if inputs.keys() != self._static.keys():
            raise KeyError(f"captured step takes inputs {sorted(self._static)}, got {sorted(inputs)}")
        for name, tensor in inputs.items():
            static = self._static[name]
            if tensor.shape != static.shape:
                raise ValueError(f"input {name!r} has shape {tuple(tensor.shape)}, captured {tuple(static.shape)}")
            static.copy_(tensor)
        self.graph.replay()
        return {name: out.clone() for name, out in self._outputs.items()}


class GraphedStep:
    """``fn(inputs) -> outputs`` (batch on dim 0) replayed from CUDA graphs, one per batch bucket.

    A batch of ``n`` runs the graph of the smallest bucket >= n, its inputs padded with
    copies of their last row, and the outputs are cut back to ``n`` rows (rows of a
    DiT batch are independent, so padding changes nothing but the matmul tile choice:
    results agree with eager within bf16 rounding). Inputs off CUDA, or larger than
    the largest bucket, run ``fn`` eagerly. Captures live in ``cache`` under
    ``key_base.with_shapes(batch_bucket=..., <input shapes>)``.
    """

    def __init__(
        self,
        fn: Callable[[TensorDict], TensorDict],
        *,
        key_base: CompileKey,
        cache: CompileCache,
        buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
        warmup: int = 2,
    ) -> None:
        self.fn = fn
        self.key_base = key_base
        self.cache = cache
        self.buckets = tuple(buckets)
        self.warmup = warmup
        self.eager_calls = 0
        self.replays = 0
        self._pool: Any = None

    def key_for(self, inputs: TensorDict, bucket: int) -> CompileKey:
        dims: dict[str, int | float | str] = {"batch_bucket": bucket}
        for name, tensor in sorted(inputs.items()):
            dims[f"{name}.shape"] = "x".join(str(d) for d in tensor.shape[1:])
            dims[f"{name}.dtype"] = str(tensor.dtype).removeprefix("torch.")
        return self.key_base.with_shapes(**dims)

    def capture(self, inputs: TensorDict) -> CompileKey:
        """Capture (or find) the graph for ``inputs``' bucket ahead of traffic; returns its key."""
        batch = next(iter(inputs.values())).shape[0]
        bucket = bucket_for(batch, self.buckets)
        if bucket is None:
            raise ValueError(f"batch {batch} is larger than the largest graph bucket {self.buckets[-1]}")
        padded = _pad_batch(inputs, bucket)
        key = self.key_for(inputs, bucket)
        self._captured(key, padded)
        return key

    def _captured(self, key: CompileKey, padded: TensorDict) -> CapturedStep:
        def build() -> CapturedStep:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()  # one pool shared by every bucket's graph
            return CapturedStep(self.fn, padded, warmup=self.warmup, pool=self._pool)

        return self.cache.get_or_build(key, build)

    def __call__(self, inputs: TensorDict) -> TensorDict:
        batch = next(iter(inputs.values())).shape[0]
        bucket = bucket_for(batch, self.buckets)
        on_cuda = all(t.device.type == "cuda" for t in inputs.values())
        if bucket is None or not on_cuda or torch.cuda.is_current_stream_capturing():
            self.eager_calls += 1
            return self.fn(inputs)
        padded = _pad_batch(inputs, bucket)
        step = self._captured(self.key_for(inputs, bucket), padded)
        self.replays += 1
        outputs = step(padded)
        return {name: out[:batch] for name, out in outputs.items()} if bucket != batch else outputs


def _pad_batch(inputs: TensorDict, bucket: int) -> TensorDict:
    padded = {}
    for name, tensor in inputs.items():
        missing = bucket - tensor.shape[0]
        if missing < 0:
            raise ValueError(f"input {name!r} has batch {tensor.shape[0]} > bucket {bucket}")
        if missing:
            tensor = torch.cat([tensor, tensor[-1:].expand(missing, *tensor.shape[1:])], dim=0)
        padded[name] = tensor
    return padded


log = logging.getLogger(__name__)


class ParityRecordError(ValueError):
    """``compute.parity_record`` names a file that is missing or not a ``TierParityRecord``."""

    field = "compute.parity_record"


def load_parity_record(path: Path | str) -> TierParityRecord:
    """The ``TierParityRecord`` in the JSON file ``path`` (``Infinity`` stands for identical videos)."""
    from fv_kernel.card.spec import TierParityRecord

    path = Path(path)
    try:
        return TierParityRecord.model_validate(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ParityRecordError(f"compute.parity_record: {str(path)!r} does not exist") from None
    except (ValueError, TypeError) as exc:  # bad JSON or a pydantic ValidationError (a ValueError)
        raise ParityRecordError(f"compute.parity_record: {str(path)!r} is not a TierParityRecord: {exc}") from None


@dataclass(frozen=True)
class TierSelection:
    """What :func:`select_compute_tiers` decided: the options to run and each active tier's verdict,
    per component. Keys of ``verdicts``, ``overridden`` and ``declined`` are ``"tier/component"``
    (``"fused/dit"``, ``"fused/vae"``, ``"graphs/dit"``...)."""

    #: The options to build with: ``fused_ops="auto"`` resolved to ``"off"`` for each component whose
    #: fused tier fails its contract (``dit_fused_ops`` / ``vae_fused_ops`` where the components differ).
    compute: ComputeOptions | None
    verdicts: Mapping[str, TierVerdict]
    #: Tiers asked for by name although their contract is not met (run anyway, warned).
    overridden: tuple[str, ...] = ()
    #: Tiers left to fv that were not selected because their contract is not met.
    declined: tuple[str, ...] = ()
    #: The tier each of the card's components runs (``dit``: e.g. ``"fused+graphs"``; ``vae``:
    #: ``"fused"`` or ``"eager"``).
    tiers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def describe(self) -> str:
        """One line: each component's tier, and why a tier left to fv was declined."""
        parts = [f"{component} {tier}" for component, tier in self.tiers.items()]
        text = ", ".join(parts) if parts else "eager"
        if self.declined:
            text += "; declined: " + "; ".join(self.verdicts[key].reason for key in self.declined)
        return text


def _component_tier(compute: ComputeOptions | None, component: str, on_cuda: bool) -> str:
    if compute is None:
        return "eager"
    fused = compute.fused_ops_for(component)
    # "torch" is eager's formulas; "auto" off CUDA (or without Triton) picks no kernels.
    kernels = fused == "triton" or (fused == "auto" and on_cuda and _triton_available())
    if component != "dit":
        return "fused" if kernels else "eager"
    base = "blocks" if compute.compile == "blocks" else "fused" if kernels else "eager"
    if not (compute.cuda_graphs and on_cuda):
        return base
    return "graphs" if base == "eager" else f"{base}+graphs"


def _triton_available() -> bool:
    from fv_kernel.compute import fused  # read at call time: tests stand Triton in on CPU

    return fused.triton_available()


def select_compute_tiers(
    compute: ComputeOptions | None, card: "ModelCard", *, device: str, precision: str, attention_backend: str,
) -> TierSelection:
    """Apply each fast tier's parity contract to ``compute`` for ``card`` at ``precision`` on ``device``,
    per component: the DiT (every ``dit`` component) apart from the VAE (every ``vae`` component).

    Only ``fused_ops="auto"`` on CUDA with Triton is a default choice (the Triton kernels); for each
    component it resolves to ``"off"`` unless the fused tier's recorded measurement on that
    component passes its contract, so a card takes the Triton kernels wherever they pass (the faster
    of the two) and eager elsewhere. A tier named explicitly (``fused_ops="triton"`` globally or in
    ``dit_fused_ops`` / ``vae_fused_ops``, ``compile="blocks"``, ``cuda_graphs`` on CUDA, attention ``vsa`` on a
    card whose recipe does not assume it) is the user's override: it is kept, and a failing or
    missing measurement is logged as a warning. ``fused_ops="torch"`` is eager's own formulas, not a tier.
    """
    from fv_kernel.card.spec import TIER_PARITY_CONTRACTS, TierParityRecord

    on_cuda = torch.device(device).type == "cuda"
    kinds = {spec.kind for spec in card.components.values()}
    components = [c for c in _FUSED_COMPONENTS if c in kinds]
    explicit: dict[tuple[str, str], bool] = {}  # (active tier, component) -> asked for by name
    if compute is not None:
        for component in components:
            mode = compute.fused_ops_for(component)
            if mode == "triton":
                explicit[("fused", component)] = True
            elif mode == "auto" and on_cuda and _triton_available():
                explicit[("fused", component)] = False
        if compute.compile == "blocks":
            explicit[("blocks", "dit")] = True
        if compute.cuda_graphs and on_cuda:  # off CUDA the step runs eagerly
            explicit[("graphs", "dit")] = True
    assumed = card.recipe.assumes_attention
    if attention_backend == "vsa" and (assumed is None or assumed.kind != "vsa"):
        explicit[("vsa", "dit")] = True  # the recipe's own attention is the card's reference, not a fast tier
    # Read even when no tier is active, so a wrong path fails at deploy, not when a tier is first turned on.
    record = load_parity_record(compute.parity_record) if compute is not None and compute.parity_record else TierParityRecord()
    verdicts = {
        f"{tier}/{component}": TIER_PARITY_CONTRACTS[tier].check(
            record.find(tier, card.model_id, precision, component), model_id=card.model_id, precision=precision,
            defaults=card.capabilities.defaults, component=component)  # type: ignore[arg-type]
        for tier, component in explicit
    }
    overridden = tuple(f"{t}/{c}" for (t, c), named in explicit.items() if named and not verdicts[f"{t}/{c}"].passed)
    declined = tuple(f"{t}/{c}" for (t, c), named in explicit.items() if not named and not verdicts[f"{t}/{c}"].passed)
    for key in overridden:
        log.warning("compute tier %r was asked for by name and runs, outside its parity contract: %s", key,
                    verdicts[key].reason)
    declined_fused = [key.split("/", 1)[1] for key in declined if key.startswith("fused/")]
    if declined_fused:
        assert compute is not None
        for component in declined_fused:
            log.info("fused_ops 'auto' leaves the Triton kernels off on the %s: %s", component,
                     verdicts[f"fused/{component}"].reason)
        compute = _with_fused_off(compute, declined_fused)
    tiers = MappingProxyType({component: _component_tier(compute, component, on_cuda) for component in components})
    selection = TierSelection(compute=compute, verdicts=MappingProxyType(verdicts), overridden=overridden,
                              declined=declined, tiers=tiers)
    if compute is not None and explicit:
        log.info("card %r compute tiers: %s", card.model_id, selection.describe())
    return selection


def _with_fused_off(compute: ComputeOptions, components: list[str]) -> ComputeOptions:
    """``compute`` with the fused ops of ``components`` off, written as plainly as possible: one
    global mode when every component now agrees, per-component modes where they differ."""
    modes = {c: ("off" if c in components else compute.fused_ops_for(c)) for c in _FUSED_COMPONENTS}
    if len(set(modes.values())) == 1:
        return compute.model_copy(update={"fused_ops": modes["dit"], "dit_fused_ops": None, "vae_fused_ops": None})
    return compute.model_copy(update={f"{c}_fused_ops": None if m == compute.fused_ops else m for c, m in modes.items()})
