"""LoRA training for fv-rl's methods (``options.lora``), adapter-only weight sync, and the adapter file.

With ``lora`` set, a method trains low-rank adapters on the card's transformer instead of its
weights: the base weights stay frozen (bit-identical through the run) and only each target
linear's ``A`` (down, ``[r, in]``) and ``B`` (up, ``[out, r]``) train, initialised as PEFT does
(``A`` Kaiming-uniform, ``B`` zero), so at step 0 the adapted transformer is the base.

The adapter runs **unmerged**, through the kernel's per-row LoRA path
(:class:`~fv_kernel.api.RowAdapters`): ``y = base(x) + (α/r)·(x·Aᵀ)·Bᵀ``. The learner's forward
(with grad) and the rollout engine's forward (no grad) apply it through the same
:class:`AdapterSlot` hooks, so a rollout reproduces the learner's function bit for bit (C2).
Several modules share one copy of the base weights (:func:`sharing_clone`): the policy, the
old policy and the KL reference of NFT/GRPO, and DMD2's student, critic and teacher.

Weight sync sends only the adapter: the rollout instance's slot swaps it in
(``Engine.sync_weights``: freeze, drain, swap, bump ``weights_version`` to
``<base>+lora-<adapter version>``, clear caches, resume). At the end the adapter is merged into
the transformer for the exported card, and written as a diffusers/PEFT safetensors file
(:func:`save_lora_file`).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator
from torch import nn

from fv_kernel.api import (
    AdapterError,
    AdapterWeights,
    Engine,
    InvalidRequest,
    LowRankUpdate,
    ModelInstance,
    RowAdapters,
)

if TYPE_CHECKING:  # pragma: no cover
    from fv_rl.rollout import Rollout

__all__ = [
    "DEFAULT_TARGETS",
    "LORA_FILE",
    "AdapterSlot",
    "LoraOptions",
    "LoraWeights",
    "StaleRollout",
    "check_rollout_versions",
    "copied_adapter",
    "lora_weights_version",
    "save_lora_file",
    "sharing_clone",
    "sync_adapter",
    "target_paths",
]

#: Every attention (self and cross) and FFN linear of the DiT's blocks (module paths, ``fnmatch`` globs).
DEFAULT_TARGETS = ("blocks.*.attn*", "blocks.*.ffn.*")
#: The adapter file a LoRA run writes under its output: diffusers' default name, so
#: ``load_lora_weights(<output>/lora)`` finds it.
LORA_FILE = Path("lora") / "pytorch_lora_weights.safetensors"
_VERSION_TAG = "+lora-"


class LoraOptions(BaseModel):
    """``options.lora`` of ``nft``, ``grpo`` and ``dmd2``: train a LoRA instead of the transformer's weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: PositiveInt = 16
    #: The LoRA scale is alpha / rank; None: alpha = rank (scale 1).
    alpha: float | None = Field(default=None, gt=0)
    #: Linear modules of the transformer to adapt: module paths or ``fnmatch`` globs over them.
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    @field_validator("target_modules")
    @classmethod
    def _some(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("target_modules must name at least one module path or glob")
        return value

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha if self.alpha is not None else self.rank)


def target_paths(root: nn.Module, patterns: Iterable[str], field: str = "options.lora.target_modules") -> list[str]:
    """The paths of ``root``'s linear modules that ``patterns`` match; a pattern matching none is an error."""
    linears = [name for name, m in root.named_modules() if isinstance(m, nn.Linear)]
    patterns = tuple(patterns)
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in linears):
            shown = linears if len(linears) <= 12 else [*linears[:12], f"... ({len(linears)} linears)"]
            raise InvalidRequest(field, f"{pattern!r} matches no linear module of the transformer", allowed=shown)
    return [name for name in linears if any(fnmatchcase(name, p) for p in patterns)]


def sharing_clone(module: nn.Module) -> nn.Module:
    """A new module object over the very same parameter and buffer tensors (no weight copy).

    Its own hooks and train/eval flags are separate, so a learner can apply an adapter to its
    clone while the serving module applies another. Refuses a module carrying slot hooks
    (they would be copied along).
    """
    for sub in module.modules():
        if any(isinstance(h, _SlotHook) for h in sub._forward_hooks.values()):
            raise RuntimeError("sharing_clone of a module with an AdapterSlot installed: clone it before installing")
    memo = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


class LoraWeights(nn.Module):
    """The trainable ``A`` / ``B`` of every target linear (fp32), PEFT's initialisation.

    ``A`` ~ Kaiming-uniform(a=√5) (PEFT's ``init_lora_weights=True``), ``B`` = 0: the adapter
    adds exactly zero until ``B`` trains.
    """

    def __init__(self, root: nn.Module, paths: Iterable[str], rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.paths = tuple(paths)
        self.rank, self.alpha = int(rank), float(alpha)
        downs, ups = [], []
        for path in self.paths:
            linear = root.get_submodule(path)
            assert isinstance(linear, nn.Linear)
            down = torch.empty(self.rank, linear.in_features, dtype=torch.float32)
            nn.init.kaiming_uniform_(down, a=math.sqrt(5), generator=generator)
            device = linear.weight.device
            downs.append(nn.Parameter(down.to(device)))
            ups.append(nn.Parameter(torch.zeros(linear.out_features, self.rank, dtype=torch.float32, device=device)))
        self.down = nn.ParameterList(downs)
        self.up = nn.ParameterList(ups)

    def adapter(self, name: str, version: str, *, detach: bool = False, component: str = "transformer") -> AdapterWeights:
        """These weights as an adapter: live (the parameters themselves, for the forward with grad)
        or ``detach``-ed copies (a snapshot to sync or save). ``version`` labels it (no content hash:
        hashing every tensor would cost more than the sync)."""
        updates = {}
        for path, down, up in zip(self.paths, self.down, self.up):
            if detach:
                down, up = down.detach().clone(), up.detach().clone()
            updates[path] = LowRankUpdate(down, up, self.alpha)
        return AdapterWeights(name, component, updates, version=version)

    def copy_from(self, other: LoraWeights) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.parameters(), other.parameters()):
                mine.copy_(theirs)


class _SlotHook:
    """One target linear's forward hook: its output plus the slot's adapter branch (if it has one there)."""

    def __init__(self, slot: AdapterSlot, path: str) -> None:
        self.slot, self.path = slot, path

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        routing = self.slot.routing(args[0].shape[0])
        return out if routing is None else routing.apply(self.path, args[0], out)


class AdapterSlot:
    """Applies one swappable adapter, unmerged, to every forward of ``root`` (all rows, strength 1).

    Forward hooks on ``paths`` (fixed when installed) add the adapter's branch with the kernel's
    per-row LoRA kernel; :meth:`set` swaps the adapter (None: the base function). An adapter
    with a target outside ``paths`` is an :class:`~fv_kernel.api.AdapterError`.
    """

    def __init__(self, root: nn.Module, paths: Iterable[str]) -> None:
        self.root = root
        self.paths = frozenset(paths)
        self.adapter: AdapterWeights | None = None
        self._routings: dict[int, RowAdapters | None] = {}
        self._handles = [root.get_submodule(p).register_forward_hook(_SlotHook(self, p)) for p in sorted(self.paths)]

    @classmethod
    def for_rollouts(cls, instance: ModelInstance, adapter: AdapterWeights) -> AdapterSlot:
        """A slot on ``instance``'s component for ``adapter``'s targets. A CUDA-graph instance is
        refused: a replayed graph runs no hooks, so its rollouts would silently ignore the adapter."""
        compute = instance.options.compute
        if compute is not None and compute.cuda_graphs:
            raise InvalidRequest("options.lora", "LoRA rollouts apply the adapter with forward hooks, which CUDA graphs do "
                                 "not replay: serve the rollout instance without compute.cuda_graphs")
        return cls(instance.component(adapter.component), adapter.low_rank)

    def set(self, adapter: AdapterWeights | None) -> None:
        if adapter is not None:
            outside = sorted(set(adapter.per_row_paths(self.root)) - self.paths)
            if outside or adapter.deltas:
                raise AdapterError(f"adapter {adapter.name!r} targets {outside or sorted(adapter.deltas)[:3]}, outside "
                                   f"this slot's {len(self.paths)} low-rank targets", param="adapters")
            adapter.check(self.root)
        self.adapter = adapter
        self._routings = {}

    def routing(self, rows: int) -> RowAdapters | None:
        """The per-row routing of a forward of ``rows`` rows (every row: the adapter at strength 1)."""
        if self.adapter is None:
            return None
        if rows not in self._routings:
            self._routings[rows] = RowAdapters.from_stacks([[(self.adapter, 1.0)]] * rows)
        return self._routings[rows]

    def loader(self, adapter: AdapterWeights) -> Callable[[ModelInstance], None]:
        """A ``sync_weights`` loader swapping in a copy of ``adapter`` on the slot's device and dtype."""

        def load(instance: ModelInstance) -> None:
            weight = next(self.root.parameters())
            self.set(copied_adapter(adapter, weight.device, weight.dtype))

        return load

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.adapter = None
        self._routings = {}


def copied_adapter(adapter: AdapterWeights, device: torch.device | str, dtype: torch.dtype | None = None) -> AdapterWeights:
    """``adapter``'s tensors copied (detached) to ``device`` / ``dtype``; same name and version."""

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().to(device=device, dtype=dtype or t.dtype, copy=True)

    low_rank = {p: LowRankUpdate(move(u.down), move(u.up), u.alpha, move(u.bias)) for p, u in adapter.low_rank.items()}  # type: ignore[arg-type]
    return AdapterWeights(adapter.name, adapter.component, low_rank, version=adapter.version)


def lora_weights_version(current: str, adapter: AdapterWeights) -> str:
    """The ``weights_version`` of an instance serving ``adapter`` on its base weights: ``<base>+lora-<version>``."""
    base = current.split(_VERSION_TAG)[0].split("+sync")[0]
    return f"{base}{_VERSION_TAG}{adapter.version}"


async def sync_adapter(engine: Engine, model_id: str, slot: AdapterSlot | None, adapter: AdapterWeights) -> AdapterSlot:
    """Adapter-only weight sync: ``Engine.sync_weights`` swapping a copy of ``adapter`` into the
    instance's slot (installed on first use, adapter-less until the swap) and setting
    ``weights_version`` to ``<base>+lora-<adapter version>``. Returns the slot."""
    instance = engine.instances[model_id]
    slot = slot or AdapterSlot.for_rollouts(instance, adapter)
    await engine.sync_weights(model_id, slot.loader(adapter), version=lora_weights_version(instance.weights_version, adapter))
    return slot


class StaleRollout(RuntimeError):
    """A rollout sampled by other weights than the adapter the learner last synced."""


def check_rollout_versions(rollouts: Sequence[Rollout], adapter_version: str) -> None:
    """Every rollout's recorded ``weights_version`` names adapter ``adapter_version``, else :class:`StaleRollout`."""
    stale = sorted({r.record.weights_version for r in rollouts if not r.record.weights_version.endswith(_VERSION_TAG + adapter_version)})
    if stale:
        raise StaleRollout(f"rollouts were sampled with weights {', '.join(map(repr, stale))}; the learner's old policy is "
                           f"adapter {adapter_version!r}: the weight sync did not reach the rollout engine")


def save_lora_file(adapter: AdapterWeights, path: Path, provenance: Mapping[str, Any]) -> Path:
    """Write ``adapter`` as a diffusers/PEFT LoRA safetensors file; returns ``path``.

    Keys ``<component>.<module>.lora_A.weight`` ``[r, in]`` / ``.lora_B.weight`` ``[out, r]`` (fp32);
    ``__metadata__["lora_adapter_metadata"]`` holds the PEFT ``LoraConfig`` fields (``r``,
    ``lora_alpha``, ``target_modules``) prefixed with the component, as diffusers'
    ``save_lora_weights`` writes them; each ``provenance`` entry is a ``fv.<key>`` metadata entry
    (strings as they are, anything else as JSON).
    """
    from safetensors.torch import save_file

    component = adapter.component
    ranks = {u.rank for u in adapter.low_rank.values()}
    alphas = {u.alpha for u in adapter.low_rank.values()}
    if adapter.deltas or len(ranks) != 1 or len(alphas) != 1 or any(u.bias is not None for u in adapter.low_rank.values()):
        raise AdapterError(f"adapter {adapter.name!r}: the file format holds one rank and alpha, low-rank updates only")
    (rank,), (alpha,) = ranks, alphas
    state: dict[str, torch.Tensor] = {}
    for module_path in sorted(adapter.low_rank):
        update = adapter.low_rank[module_path]
        state[f"{component}.{module_path}.lora_A.weight"] = update.down.detach().to("cpu", torch.float32).contiguous()
        state[f"{component}.{module_path}.lora_B.weight"] = update.up.detach().to("cpu", torch.float32).contiguous()
    config = {"r": rank, "lora_alpha": float(alpha if alpha is not None else rank), "target_modules": sorted(adapter.low_rank),
              "lora_bias": False}
    metadata = {"format": "pt", "lora_adapter_metadata": json.dumps({f"{component}.{k}": v for k, v in config.items()}, sort_keys=True)}
    for key, value in provenance.items():
        metadata[f"fv.{key}"] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=metadata)
    return path
