"""Low-rank adapters (LoRA) as data, and how they are applied (docs/adapters.md).

An adapter is a set of updates to named modules of one component, in that component's own
module names (a family's converter maps each file format onto them):

- :class:`LowRankUpdate` on a linear module: ``y += s·(α/r)·(x·Aᵀ)·Bᵀ (+ s·bias)``;
- a full delta on any parameter (``.diff`` / ``.diff_b`` entries): ``P += s·ΔP``.

``s`` is the strength a request (or a card's default stack) gives the adapter. Two ways to
apply a stack, which agree to rounding:

- **merged** (:func:`merge_adapters`): the updates are added into the weights in fp32 and cast
  back (ComfyUI's rule); the forward then costs nothing extra. The originals are kept, so
  :meth:`MergedAdapters.restore` gives the base weights back bit-exactly.
- **per row** (:class:`RowAdapters`, :func:`rows_adapted`): the base linear runs once for all
  rows of a batched forward, then each row's updates are added, rows grouped into one segment
  per adapter (Punica's segmented gather GEMM: shrink ``x·Aᵀ``, expand ``·Bᵀ``; in Triton on
  CUDA, :mod:`fv_kernel.compute.lora_triton`, else in torch). Requests with
  different adapters share one forward. A full delta is applied per row only on a linear's
  weight or bias; one on another parameter (a modulation table, a norm) can only be merged.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fv_kernel.compute.fp8 import Fp8Linear
from fv_kernel.compute.lora_triton import RowKernelUnavailable, lora_sgmv, rank_block
from fv_kernel.errors import FvError

__all__ = [
    "AdapterError",
    "AdapterKeyError",
    "LowRankUpdate",
    "AdapterWeights",
    "AdapterStack",
    "MergedAdapters",
    "merge_adapters",
    "stack_key",
    "RowAdapters",
    "RowKernel",
    "RowKernelUnavailable",
    "ROW_KERNELS",
    "AutoRowKernel",
    "TritonRowKernel",
    "select_row_kernel",
    "rows_adapted",
]

#: One adapter at one strength; a stack applies its entries' updates summed, in order.
AdapterStack = Sequence[tuple["AdapterWeights", float]]


class AdapterError(FvError, ValueError):
    """An adapter that cannot be applied as asked (a shape, a target, a merge-only delta)."""

    error_type = "invalid_adapter"


class AdapterKeyError(AdapterError):
    """An adapter entry maps to no module or parameter of its component: named, never dropped."""

    error_type = "adapter_keys"

    def __init__(self, adapter: str, component: str, keys: Sequence[str], known: Sequence[str]) -> None:
        hints = []
        for key in keys[:4]:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        more = f", ... ({len(keys) - 4} more)" if len(keys) > 4 else ""
        super().__init__(
            f"adapter {adapter!r}: {len(keys)} entr{'y' if len(keys) == 1 else 'ies'} match no module of "
            f"component {component!r}: {', '.join(hints)}{more}",
            param="adapters",
        )
        self.keys = list(keys)


@dataclass(frozen=True)
class LowRankUpdate:
    """One linear module's LoRA: ``ΔW = (α/r)·B·A``, ``A`` (down) ``[r, in]``, ``B`` (up) ``[out, r]``.

    ``alpha`` None means a scale of 1 (no ``.alpha`` entry, or alpha already folded into A and B).
    ``bias`` is an update of the module's bias, scaled by the strength but not by ``α/r``: a
    converter folds ``α/r`` into it where the format scales it (PEFT's ``lora_B.bias``, which
    sits inside ``lora_B``), and leaves a ``.diff_b`` as it is.
    """

    down: torch.Tensor
    up: torch.Tensor
    alpha: float | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.down.dim() != 2 or self.up.dim() != 2:
            raise AdapterError(f"LoRA down/up must be 2-D, got {tuple(self.down.shape)} and {tuple(self.up.shape)}")
        if self.up.shape[1] != self.down.shape[0]:
            raise AdapterError(
                f"LoRA up {tuple(self.up.shape)} does not follow down {tuple(self.down.shape)}: "
                f"up must be [out, rank] with rank = down.shape[0] = {self.down.shape[0]}"
            )
        if self.bias is not None and tuple(self.bias.shape) != (self.up.shape[0],):
            raise AdapterError(f"LoRA bias must be [{self.up.shape[0]}], got {tuple(self.bias.shape)}")

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.down.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.up.shape[0])

    @property
    def scale(self) -> float:
        """``α/r``, the factor PEFT, diffusers and ComfyUI all apply (1 without an alpha)."""
        return 1.0 if self.alpha is None else float(self.alpha) / self.rank

    def weight_delta(self) -> torch.Tensor:
        """``(α/r)·B·A`` in fp32."""
        return (self.up.float() @ self.down.float()) * self.scale

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "LowRankUpdate":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype or t.dtype)

        return LowRankUpdate(move(self.down), move(self.up), self.alpha, move(self.bias))  # type: ignore[arg-type]


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's updates to one component (``transformer``, ``transformer_2``, ``text_encoder``…).

    ``low_rank`` maps a linear module's path (``blocks.0.attn1.to_q``) to its update; ``deltas``
    maps a parameter's path (``blocks.0.scale_shift_table``, ``blocks.0.attn1.to_q.weight``) to a
    full delta. ``version`` is a content hash of every tensor and scalar, so two files with the
    same name but other weights never share a cache entry.
    """

    name: str
    component: str
    low_rank: Mapping[str, LowRankUpdate] = field(default_factory=dict)
    deltas: Mapping[str, torch.Tensor] = field(default_factory=dict)
    version: str = ""
    #: Components this adapter was checked against: a batched forward enters ``rows_adapted`` every
    #: step, and walking a 1.3B model's modules for each of 8 adapters took ~100 ms of host time.
    _checked: weakref.WeakKeyDictionary[nn.Module, bool] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False
    )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # What crosses a process (Ray actors, multiprocessing) or a deepcopy is the data; the
        # check cache (weak references to this process's modules) stays behind.
        return (type(self), (self.name, self.component, dict(self.low_rank), dict(self.deltas), self.version))

    def __post_init__(self) -> None:
        if not self.name:
            raise AdapterError("an adapter needs a name")
        if not self.low_rank and not self.deltas:
            raise AdapterError(f"adapter {self.name!r} has no updates for component {self.component!r}")
        if not self.version:
            object.__setattr__(self, "version", self._content_version())

    def _content_version(self) -> str:
        digest = hashlib.sha256(self.component.encode())

        def feed(label: str, tensor: torch.Tensor | None) -> None:
            digest.update(f"|{label}".encode())
            if tensor is not None:
                t = tensor.detach().cpu().contiguous()
                digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
                digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")

        for path in sorted(self.low_rank):
            u = self.low_rank[path]
            feed(f"{path}:down", u.down)
            feed(f"{path}:up", u.up)
            feed(f"{path}:alpha={u.alpha!r}", None)
            feed(f"{path}:bias", u.bias)
        for path in sorted(self.deltas):
            feed(f"{path}:delta", self.deltas[path])
        return digest.hexdigest()[:16]

    @property
    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.deltas.values())
        for u in self.low_rank.values():
            total += sum(t.numel() * t.element_size() for t in (u.down, u.up, u.bias) if t is not None)
        return total

    @property
    def max_rank(self) -> int:
        return max((u.rank for u in self.low_rank.values()), default=0)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "AdapterWeights":
        """The same adapter (same version) with its tensors on ``device`` (and in ``dtype``)."""
        return AdapterWeights(
            self.name, self.component,
            {p: u.to(device, dtype) for p, u in self.low_rank.items()},
            {p: t.to(device=device, dtype=dtype or t.dtype) for p, t in self.deltas.items()},
            version=self.version,
        )

    def per_row_paths(self, root: nn.Module) -> set[str]:
        """The linear modules this adapter touches per row (its low-rank targets and the linears
        whose weight or bias it has a full delta for)."""
        paths = set(self.low_rank)
        for param in self.deltas:
            module_path, _, leaf = param.rpartition(".")
            if leaf in ("weight", "bias") and isinstance(_submodule(root, module_path), LINEAR_TYPES):
                paths.add(module_path)
        return paths

    def merge_only_params(self, root: nn.Module) -> list[str]:
        """Full deltas on parameters that are not a linear's weight or bias: applied merged only."""
        out = []
        for param in self.deltas:
            module_path, _, leaf = param.rpartition(".")
            if leaf not in ("weight", "bias") or not isinstance(_submodule(root, module_path), LINEAR_TYPES):
                out.append(param)
        return sorted(out)

    def check(self, root: nn.Module) -> None:
        """Every entry targets a module or parameter of ``root`` with matching shapes, or
        :class:`AdapterKeyError` / :class:`AdapterError` names the first ones that do not.
        Remembered per ``root`` once it passes (a module's shapes do not change under it)."""
        if self._checked.get(root):
            return
        linears = {name: m for name, m in root.named_modules() if isinstance(m, LINEAR_TYPES)}
        # An fp8 linear's e4m3 weight is a buffer: a full delta on it applies per row, as on a parameter.
        params = {**dict(root.named_parameters()),
                  **{f"{name}.weight": m.weight for name, m in linears.items() if isinstance(m, Fp8Linear)}}
        missing = [p for p in self.low_rank if p not in linears] + [p for p in self.deltas if p not in params]
        if missing:
            raise AdapterKeyError(self.name, self.component, sorted(missing), sorted(set(linears) | set(params)))
        for path, update in self.low_rank.items():
            linear = linears[path]
            if (update.out_features, update.in_features) != tuple(linear.weight.shape):
                raise AdapterError(
                    f"adapter {self.name!r}: {path} is [{linear.out_features}, {linear.in_features}] but its "
                    f"LoRA makes [{update.out_features}, {update.in_features}] (up {tuple(update.up.shape)}, "
                    f"down {tuple(update.down.shape)}); are up and down swapped?",
                    param="adapters",
                )
            if update.bias is not None and linear.bias is None:
                raise AdapterError(f"adapter {self.name!r}: {path} has no bias for the LoRA's bias update", param="adapters")
        for path, delta in self.deltas.items():
            if tuple(delta.shape) != tuple(params[path].shape):
                raise AdapterError(
                    f"adapter {self.name!r}: delta for {path} is {tuple(delta.shape)}, the parameter is "
                    f"{tuple(params[path].shape)}",
                    param="adapters",
                )
        self._checked[root] = True


#: The modules a LoRA targets: bf16/fp32 linears, and fp8 ones (per row only: their e4m3 weights never merge).
LINEAR_TYPES = (nn.Linear, Fp8Linear)


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


# --------------------------------------------------------------------------- merged


@dataclass
class MergedAdapters:
    """A stack merged into a component's weights, with the originals kept for :meth:`restore`."""

    root: nn.Module
    stack_key: tuple[tuple[str, str, float], ...]
    originals: dict[str, torch.Tensor]

    def restore(self) -> None:
        """The base weights back, bit-exactly (copied, not subtracted)."""
        params = dict(self.root.named_parameters())
        with torch.no_grad():
            for path, original in self.originals.items():
                params[path].copy_(original)
        self.originals = {}


def stack_key(stack: AdapterStack) -> tuple[tuple[str, str, float], ...]:
    """What identifies a stack's effect: each adapter's name, version and strength, in order."""
    return tuple((adapter.name, adapter.version, float(scale)) for adapter, scale in stack)


def merge_adapters(root: nn.Module, stack: AdapterStack) -> MergedAdapters:
    """Add a stack's updates into ``root``'s weights: ``P ← cast(P + Σ s·ΔP)``, summed in fp32.

    Every adapter is checked against ``root`` first, so a bad one changes nothing.
    """
    for adapter, _ in stack:
        adapter.check(root)
    fp8 = sorted(path for adapter, _ in stack for path in adapter.per_row_paths(root)
                 if isinstance(_submodule(root, path), Fp8Linear))
    if fp8:
        raise AdapterError(f"{fp8[0]} is an fp8 linear: a LoRA applies to it per row, never merged into its e4m3 "
                           "weight", param="adapters")
    params = dict(root.named_parameters())
    updates: dict[str, torch.Tensor] = {}

    def add(path: str, delta: torch.Tensor) -> None:
        delta = delta.to(device=params[path].device, dtype=torch.float32)
        updates[path] = updates[path] + delta if path in updates else delta

    for adapter, scale in stack:
        for path, update in adapter.low_rank.items():
            add(f"{path}.weight", update.weight_delta() * scale)
            if update.bias is not None:
                add(f"{path}.bias", update.bias.float() * scale)
        for path, delta in adapter.deltas.items():
            add(path, delta.float() * scale)
    originals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for path, delta in updates.items():
            param = params[path]
            originals[path] = param.detach().clone()
            param.copy_((param.float() + delta).to(param.dtype))
    return MergedAdapters(root, stack_key(stack), originals)


# --------------------------------------------------------------------------- per row


@dataclass(frozen=True)
class _Segment:
    """The rows of one batched forward that use one adapter, and each row's strength."""

    adapter: AdapterWeights
    rows: torch.Tensor  # int64 [n]
    scales: torch.Tensor  # fp32 [n]


#: A per-row kernel: ``(x, out, segments, path) -> None``, adding each segment's update for the
#: linear at ``path`` into ``out`` in place. ``x``/``out`` have the rows on dim 0.
RowKernel = Callable[[torch.Tensor, torch.Tensor, Sequence[_Segment], str], None]

#: The names :class:`RowAdapters` takes for its ``kernel``.
ROW_KERNELS = ("auto", "torch", "triton")


def _torch_row_kernel(
    x: torch.Tensor, out: torch.Tensor, segments: Sequence[_Segment], path: str, *, low_rank: bool = True
) -> None:
    """The portable path: for each adapter, gather its rows, shrink, expand, scatter-add.

    ``low_rank=False`` adds only the LoRA biases and full deltas (the Triton kernel's remainder).
    """
    for seg in segments:
        update = seg.adapter.low_rank.get(path)
        lora_bias = update.bias if update is not None else None
        update = update if low_rank else None
        weight = seg.adapter.deltas.get(f"{path}.weight")
        bias = seg.adapter.deltas.get(f"{path}.bias")
        if update is None and weight is None and bias is None and lora_bias is None:
            continue
        rows = seg.rows.to(x.device)
        xs = x.index_select(0, rows)
        shape = (-1,) + (1,) * (xs.dim() - 1)
        scales = seg.scales.to(device=x.device, dtype=torch.float32).view(shape)
        delta = torch.zeros((), dtype=x.dtype, device=x.device)
        if update is not None:
            down = update.down.to(device=x.device, dtype=x.dtype)
            up = update.up.to(device=x.device, dtype=x.dtype)
            delta = (xs @ down.t()) @ up.t() * update.scale
        if lora_bias is not None:
            delta = delta + lora_bias.to(device=x.device, dtype=x.dtype)
        if weight is not None:
            delta = delta + xs @ weight.to(device=x.device, dtype=x.dtype).t()
        if bias is not None:
            delta = delta + bias.to(device=x.device, dtype=x.dtype)
        shape_rows = (rows.numel(),) + tuple(out.shape[1:])
        out.index_add_(0, rows, (delta.float() * scales).to(out.dtype).expand(shape_rows))


def _on_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without a stream sync (pinned, non-blocking) on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class TritonRowKernel:
    """The per-row update as a segmented gather GEMM in Triton (:mod:`fv_kernel.compute.lora_triton`).

    Low-rank updates of all segments go through two launches per linear (shrink, expand), their
    adapters' ``A``/``B`` stacked and zero-padded to one rank block; LoRA biases and full deltas
    (rare, and cheap: one add per row) take the torch path. Stacks are kept per linear and set of
    adapters (keyed by versions), least recently used dropped past ``max_stack_bytes``; routings
    per content (rows, strengths), at most ``max_routes``. An instance kept across forwards (the
    steps of one batch) so builds them once; a Wan 1.3B rank-32 LoRA on every attention and FFN
    linear stacks to about 87 MB. Not differentiable: ``kernel='auto'`` takes the torch path when
    autograd needs the update.
    """

    def __init__(self, *, max_stack_bytes: int = 2 << 30, max_routes: int = 1024) -> None:
        from fv_kernel.compute.fused import triton_available

        if not triton_available():
            raise RowKernelUnavailable("kernel='triton' needs the triton package, which is not importable")
        self.max_stack_bytes = max_stack_bytes
        self.max_routes = max_routes
        self._stacks: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._routes: dict[tuple[object, ...], tuple[torch.Tensor, ...]] = {}

    @property
    def stack_bytes(self) -> int:
        return sum(d.nbytes + u.nbytes for d, u, _ in self._stacks.values())

    def _stack(
        self, path: str, adapters: Sequence[AdapterWeights], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (path, tuple((a.name, a.version) for a in adapters), dtype, device)
        if key in self._stacks:
            self._stacks[key] = self._stacks.pop(key)  # most recently used last
            return self._stacks[key]
        updates = [a.low_rank[path] for a in adapters]
        block = rank_block(max(u.rank for u in updates))
        # Zero ranks pad each adapter up to the block; adapters of one rank (the usual case) stack in
        # one copy kernel each for A and B (this runs per linear, so launches count).
        rank = updates[0].rank if len({u.rank for u in updates}) == 1 else None
        if rank is not None:
            downs = torch.stack([u.down.to(device=device, dtype=dtype) for u in updates])
            ups = torch.stack([u.up.to(device=device, dtype=dtype) for u in updates])
            if rank < block:
                downs, ups = F.pad(downs, (0, 0, 0, block - rank)), F.pad(ups, (0, block - rank))
        else:
            downs = torch.stack([F.pad(u.down.to(device=device, dtype=dtype), (0, 0, 0, block - u.rank)) for u in updates])
            ups = torch.stack([F.pad(u.up.to(device=device, dtype=dtype), (0, block - u.rank)) for u in updates])
        value = (downs, ups, _on_device([u.scale for u in updates], torch.float32, device))
        self._stacks[key] = value
        while len(self._stacks) > 1 and self.stack_bytes > self.max_stack_bytes:
            self._stacks.pop(next(iter(self._stacks)))
        return value

    def _routing(self, segments: Sequence[_Segment], device: torch.device) -> tuple[torch.Tensor, ...]:
        key = (tuple((s.adapter.name, s.adapter.version, tuple(s.rows.tolist()), tuple(s.scales.tolist())) for s in segments), device)
        if key in self._routes:
            self._routes[key] = self._routes.pop(key)
            return self._routes[key]
        value = self._routes[key] = self._route(segments, device)
        while len(self._routes) > self.max_routes:
            self._routes.pop(next(iter(self._routes)))
        return value

    @staticmethod
    def _route(segments: Sequence[_Segment], device: torch.device) -> tuple[torch.Tensor, ...]:
        entries = sorted(
            (int(row), slot, float(scale))
            for slot, seg in enumerate(segments)
            for row, scale in zip(seg.rows.tolist(), seg.scales.tolist())
        )
        active = sorted({row for row, _, _ in entries})
        starts = [0]
        for row in active:
            starts.append(starts[-1] + sum(1 for r, _, _ in entries if r == row))
        return (
            _on_device([r for r, _, _ in entries], torch.int32, device),
            _on_device([s for _, s, _ in entries], torch.int32, device),
            _on_device([c for _, _, c in entries], torch.float32, device),
            _on_device(active, torch.int32, device),
            _on_device(starts, torch.int32, device),
        )

    def __call__(self, x: torch.Tensor, out: torch.Tensor, segments: Sequence[_Segment], path: str) -> None:
        low_rank = [seg for seg in segments if path in seg.adapter.low_rank]
        if low_rank:
            downs, ups, slot_scales = self._stack(path, [seg.adapter for seg in low_rank], x.dtype, x.device)
            route = self._routing(low_rank, x.device)
            x3 = x.reshape(x.shape[0], -1, x.shape[-1]).contiguous()
            target = out if out.is_contiguous() else out.contiguous()
            lora_sgmv(x3, target.view(out.shape[0], -1, out.shape[-1]), downs, ups, slot_scales, *route)  # type: ignore[misc]
            if target is not out:
                out.copy_(target)
        _torch_row_kernel(x, out, segments, path, low_rank=False)


def _needs_autograd(x: torch.Tensor, segments: Sequence[_Segment], path: str) -> bool:
    if not torch.is_grad_enabled():
        return False
    if x.requires_grad:
        return True
    for seg in segments:
        update = seg.adapter.low_rank.get(path)
        if update is not None and (update.down.requires_grad or update.up.requires_grad):
            return True
    return False


class AutoRowKernel:
    """``kernel='auto'``: Triton for CUDA tensors when triton is importable and no gradient is needed
    through the update; the torch path otherwise (CPU, no triton, LoRA training)."""

    def __init__(self) -> None:
        self._triton: TritonRowKernel | None = None

    def pick(self, x: torch.Tensor, segments: Sequence[_Segment], path: str) -> RowKernel:
        """The kernel this call runs: reads only ``x.device`` and whether autograd needs the update."""
        from fv_kernel.compute.fused import triton_available

        if x.device.type == "cuda" and triton_available() and not _needs_autograd(x, segments, path):
            if self._triton is None:
                self._triton = TritonRowKernel()
            return self._triton
        return _torch_row_kernel

    def __call__(self, x: torch.Tensor, out: torch.Tensor, segments: Sequence[_Segment], path: str) -> None:
        self.pick(x, segments, path)(x, out, segments, path)


def select_row_kernel(kernel: "RowKernel | str | None") -> RowKernel:
    """The per-row kernel for ``kernel``: ``'auto'`` (or None), ``'torch'``, ``'triton'``, or a callable."""
    if kernel is None or kernel == "auto":
        return AutoRowKernel()
    if kernel == "torch":
        return _torch_row_kernel
    if kernel == "triton":
        return TritonRowKernel()
    if callable(kernel):
        return kernel
    raise AdapterError(f"kernel must be one of {', '.join(map(repr, ROW_KERNELS))} or a callable; got {kernel!r}", param="kernel")


class RowAdapters:
    """Which adapters, at which strengths, each row of one batched forward of one component uses.

    Build it from one stack per row (:meth:`from_stacks`; an empty stack is a row with no
    adapter), or from the ``adapter_ids`` / ``adapter_scales`` tensors a loop puts in a step's
    inputs (:meth:`from_ids`). Apply it with :func:`rows_adapted` around the forward.

    ``kernel`` computes the updates: ``'auto'`` (None) picks the Triton segmented GEMM for CUDA
    tensors when triton is importable and no gradient must flow through the update, else the torch
    path; ``'torch'`` and ``'triton'`` force one; a callable (:data:`RowKernel`) replaces both.
    """

    def __init__(self, rows: int, segments: Sequence[_Segment], *, kernel: RowKernel | str | None = None) -> None:
        self.rows = rows
        self.segments = tuple(segments)
        self.kernel: RowKernel = select_row_kernel(kernel)

    @classmethod
    def from_stacks(cls, stacks: Sequence[AdapterStack], *, kernel: RowKernel | str | None = None) -> "RowAdapters | None":
        """None when no row has an adapter (the forward then runs exactly as without this)."""
        by_adapter: dict[tuple[str, str], tuple[AdapterWeights, list[int], list[float]]] = {}
        for row, stack in enumerate(stacks):
            for adapter, scale in stack:
                entry = by_adapter.setdefault((adapter.name, adapter.version), (adapter, [], []))
                entry[1].append(row)
                entry[2].append(float(scale))
        if not by_adapter:
            return None
        # Segments in one order whatever else the batch holds (by name, version): a row's stack is then
        # summed in the same order batched as alone, so its result does not depend on its neighbours.
        segments = [
            _Segment(adapter, torch.tensor(rows, dtype=torch.int64), torch.tensor(scales, dtype=torch.float32))
            for _, (adapter, rows, scales) in sorted(by_adapter.items())
        ]
        return cls(len(stacks), segments, kernel=kernel)

    @classmethod
    def from_ids(
        cls,
        ids: torch.Tensor,
        scales: torch.Tensor,
        lookup: Callable[[int], AdapterWeights],
        *,
        kernel: RowKernel | str | None = None,
    ) -> "RowAdapters | None":
        """From ``ids`` ``[rows, k]`` (−1 pads a shorter stack) and ``scales`` ``[rows, k]``."""
        if ids.dim() != 2 or tuple(ids.shape) != tuple(scales.shape):
            raise AdapterError(
                f"adapter_ids and adapter_scales must both be [rows, k], got {tuple(ids.shape)} and {tuple(scales.shape)}"
            )
        ids_list, scales_list = ids.tolist(), scales.tolist()
        stacks = [
            [(lookup(int(i)), float(s)) for i, s in zip(row_ids, row_scales) if int(i) >= 0]
            for row_ids, row_scales in zip(ids_list, scales_list)
        ]
        return cls.from_stacks(stacks, kernel=kernel)

    def paths(self, root: nn.Module) -> set[str]:
        out: set[str] = set()
        for seg in self.segments:
            out |= seg.adapter.per_row_paths(root)
        return out

    def check(self, root: nn.Module) -> None:
        for seg in self.segments:
            seg.adapter.check(root)
            merge_only = seg.adapter.merge_only_params(root)
            if merge_only:
                raise AdapterError(
                    f"adapter {seg.adapter.name!r} has full deltas on {', '.join(merge_only[:3])}"
                    f"{' ...' if len(merge_only) > 3 else ''}, which are applied merged only; it cannot share "
                    "a batched forward with other adapters",
                    param="adapters",
                )

    def apply(self, path: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base linear's output for ``x``) with each row's updates for ``path`` added."""
        if x.shape[0] != self.rows:
            raise AdapterError(f"{path}: the forward has {x.shape[0]} rows, the adapter routing {self.rows}")
        segments = [
            s for s in self.segments
            if path in s.adapter.low_rank or f"{path}.weight" in s.adapter.deltas or f"{path}.bias" in s.adapter.deltas
        ]
        if segments:
            out = out.clone() if out.requires_grad or out._base is not None else out
            self.kernel(x, out, segments, path)
        return out


@contextlib.contextmanager
def rows_adapted(root: nn.Module, routing: RowAdapters | None) -> Iterator[None]:
    """Apply ``routing`` to every linear of ``root`` it targets, for the forwards run inside.

    The hooks live only inside the ``with``: nothing about a request stays on the module.
    """
    if routing is None:
        yield
        return
    routing.check(root)
    handles = []
    try:
        for path in sorted(routing.paths(root)):
            module = root.get_submodule(path)

            def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, _path: str = path) -> torch.Tensor:
                return routing.apply(_path, args[0], out)

            handles.append(module.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
