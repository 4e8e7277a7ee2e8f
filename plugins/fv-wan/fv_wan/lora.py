"""Wan LoRA files -> :class:`AdapterWeights` in fv's module names (diffusers' ``WanTransformer3DModel``).

Formats read (one file may mix the original-name ones, as LightX2V/CausVid files do):

- diffusers / PEFT: ``transformer.blocks.0.attn1.to_q.lora_A.weight`` / ``.lora_B.weight`` /
  ``.lora_B.bias`` (also ``transformer_2.``, ``text_encoder.`` and PEFT's own
  ``base_model.model.`` prefix); the safetensors metadata ``lora_adapter_metadata`` (PEFT
  ``LoraConfig``: ``lora_alpha``, ``r``, ``alpha_pattern``, ``rank_pattern``, ``use_rslora``) is
  honoured as diffusers does.
- original Wan / ComfyUI / diffusion-pipe: ``diffusion_model.blocks.0.self_attn.q.lora_down.weight``
  / ``.lora_up.weight`` / ``.alpha`` (or ``lora_A`` / ``lora_B`` under these names).
- kohya / Musubi: ``lora_unet_blocks_0_self_attn_q.lora_down.weight``; Wan-Fun's ``lora_unet__``.
- full deltas: ``<module>.diff`` (ΔW), ``<module>.diff_b`` (Δbias), ``<param>.diff`` /
  ``.diff_m`` on a parameter that is not a linear's (``blocks.0.modulation`` -> merged only).
  Norm deltas that are all zero (LightX2V/CausVid ship them so) change nothing and are dropped;
  a non-zero norm delta is kept and applied merged.

Original names go through the checkpoint key map of :mod:`fv_wan.models.transformer`, so the LoRA
and checkpoint converters cannot disagree. The scale is ``alpha/rank`` (1 without an alpha).

Wan 2.2 A14B has two experts; one file adapts one of them. Keys prefixed ``transformer_2.`` go
to the low-noise expert. Any other file goes to ``transformer`` (the high-noise expert) unless
the adapter's name ends in ``.transformer_2`` (a file ``lightx2v_low.transformer_2.safetensors``)
or its safetensors metadata says ``"fv_component": "transformer_2"``; this is diffusers'
``load_lora_weights(..., load_into_transformer_2=True)``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fv_kernel.api import AdapterError, AdapterKeyError, AdapterWeights, LowRankUpdate
from fv_wan.models.transformer import ORIGINAL_KEY_PREFIXES, original_key_to_diffusers

__all__ = ["COMPONENT_METADATA_KEY", "EXPERT_COMPONENTS", "convert_wan_lora", "target_component"]

#: The denoisers an un-prefixed file can be aimed at (Wan 2.2 A14B: high-, low-noise expert).
EXPERT_COMPONENTS: tuple[str, ...] = ("transformer", "transformer_2")
#: safetensors ``__metadata__`` key naming the expert a file adapts.
COMPONENT_METADATA_KEY = "fv_component"
#: diffusers' metadata key holding the PEFT ``LoraConfig`` as JSON.
PEFT_METADATA_KEY = "lora_adapter_metadata"

#: Key prefix -> (component, naming). "diffusers": fv's own module names; "original": the
#: original Wan names; "kohya": original names joined by "_". Longest prefixes first.
_PREFIXES: tuple[tuple[str, str | None, str], ...] = (
    ("base_model.model.", None, "diffusers"),
    ("transformer_2.", "transformer_2", "diffusers"),
    ("transformer.", None, "diffusers"),
    ("text_encoder.", "text_encoder", "diffusers"),
    *((p, None, "original") for p in ORIGINAL_KEY_PREFIXES),
    ("lora_unet__", None, "kohya"),  # Wan-Fun (VideoX-Fun)
    ("lora_unet_", None, "kohya"),
)

#: Entry suffix -> role. Checked longest first.
_SUFFIXES: tuple[tuple[str, str], ...] = (
    (".lora_down.weight", "down"),
    (".lora_A.weight", "down"),
    (".lora_up.weight", "up"),
    (".lora_B.weight", "up"),
    (".lora_B.bias", "bias"),
    (".alpha", "alpha"),
    (".diff_b", "diff_b"),
    (".diff_m", "diff"),
    (".diff", "diff"),
)


@dataclass
class _Module:
    """What one file holds for one module (or parameter) of one component."""

    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    alpha: float | None = None
    bias: torch.Tensor | None = None
    diff: torch.Tensor | None = None
    diff_b: torch.Tensor | None = None
    source: str = ""
    origin: str = "transformer"
    #: ``diff`` is a delta of the parameter at the path itself (a modulation table), not of a linear's weight.
    bare_param: bool = False


def target_component(name: str, metadata: Mapping[str, str]) -> str:
    """The expert an un-prefixed (or ``transformer.``-prefixed) file adapts: metadata, name suffix, default."""
    chosen = metadata.get(COMPONENT_METADATA_KEY)
    if chosen is not None and chosen not in EXPERT_COMPONENTS:
        raise AdapterError(
            f"adapter {name!r}: metadata {COMPONENT_METADATA_KEY}={chosen!r}; allowed: {', '.join(EXPERT_COMPONENTS)}",
            param="adapters",
        )
    suffix = next((c for c in EXPERT_COMPONENTS if name.endswith(f".{c}")), None)
    if chosen is not None and suffix is not None and suffix != chosen:
        raise AdapterError(
            f"adapter {name!r}: its name says {suffix!r} but its metadata {COMPONENT_METADATA_KEY} says {chosen!r}",
            param="adapters",
        )
    return chosen or suffix or "transformer"


def convert_wan_lora(
    state_dict: Mapping[str, torch.Tensor], *, name: str, metadata: Mapping[str, str] | None = None
) -> dict[str, AdapterWeights]:
    """A Wan LoRA file's tensors as one :class:`AdapterWeights` per component it adapts.

    Raises :class:`AdapterKeyError` naming every key that maps to nothing, and
    :class:`AdapterError` for DoRA files, a down without its up (or the reverse), or a bad alpha.
    """
    metadata = dict(metadata or {})
    dora = sorted(k for k in state_dict if "dora_scale" in k)
    if dora:
        raise AdapterError(
            f"adapter {name!r} is a DoRA file ({len(dora)} 'dora_scale' entries, e.g. {dora[0]!r}); fv applies "
            "LoRA (low-rank and full-delta) updates only, and dropping the magnitude vectors would change the result",
            param="adapters",
        )
    default = target_component(name, metadata)
    modules: dict[tuple[str, str], _Module] = {}
    unmapped: list[str] = []
    for key, tensor in state_dict.items():
        parsed = _parse_key(key)
        if parsed is None:
            unmapped.append(key)
            continue
        component, naming, path, role = parsed
        # PEFT metadata is keyed by the file's own prefix, which a redirect to an expert does not change.
        origin = component or "transformer"
        if component is None:
            component = default
        if component == "text_encoder":
            # diffusers names the UMT5 modules from the HF model, which fv's text encoder holds as .model
            path = f"model.{path}"
        elif naming != "diffusers":
            mapped = _map_original(path, role, underscores=naming == "kohya")
            if mapped is None:
                unmapped.append(key)
                continue
            path, role = mapped
        entry = modules.setdefault((component, path), _Module(source=key, origin=origin))
        _store(entry, role, tensor, key, name)
    if unmapped:
        raise AdapterKeyError(name, default, sorted(unmapped), [])
    peft = _peft_config(metadata, name)
    by_component: dict[str, tuple[dict[str, LowRankUpdate], dict[str, torch.Tensor]]] = {}
    for (component, path), entry in sorted(modules.items()):
        low_rank, deltas = by_component.setdefault(component, ({}, {}))
        _build(entry, component, path, name, peft.get(entry.origin), low_rank, deltas)
    out = {
        component: AdapterWeights(name, component, low_rank, deltas)
        for component, (low_rank, deltas) in by_component.items()
        if low_rank or deltas
    }
    if not out:
        raise AdapterError(f"adapter {name!r} has no updates (empty, or only all-zero norm deltas)", param="adapters")
    return out


def _parse_key(key: str) -> tuple[str | None, str, str, str] | None:
    """(component or None for "the default expert", naming, module path, role), or None."""
    for prefix, component, naming in _PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):]
            break
    else:
        return None
    for suffix, role in _SUFFIXES:
        if rest.endswith(suffix):
            path = rest[: -len(suffix)]
            return (component, naming, path, role) if path else None
    return None


def _map_original(path: str, role: str, *, underscores: bool) -> tuple[str, str] | None:
    """An original-name module path (and role) in fv's names, via the checkpoint key map.

    A LoRA or ``.diff`` names a linear (``blocks.0.self_attn.q`` -> its ``.weight``); a ``.diff``
    can also name a bare parameter (``blocks.0.modulation``), kept as a delta on that parameter.
    """
    if role == "diff_b":
        mapped = original_key_to_diffusers(f"{path}.bias", underscores=underscores)
        return None if mapped is None else (mapped[: -len(".bias")], role)
    weight = original_key_to_diffusers(f"{path}.weight", underscores=underscores)
    if weight is not None:
        return weight[: -len(".weight")], role
    if role == "diff":
        param = original_key_to_diffusers(path, underscores=underscores)
        if param is not None:
            return param, "param_diff"
    return None


def _store(entry: _Module, role: str, tensor: torch.Tensor, key: str, name: str) -> None:
    if role == "alpha":
        if tensor.numel() != 1:
            raise AdapterError(f"adapter {name!r}: {key} must be a scalar, got shape {tuple(tensor.shape)}", param="adapters")
        entry.alpha = float(tensor.item())
        return
    slot = {"param_diff": "diff"}.get(role, role)
    if getattr(entry, slot) is not None:
        raise AdapterError(f"adapter {name!r}: two entries for the same update ({key} and {entry.source})", param="adapters")
    setattr(entry, slot, tensor)
    entry.bare_param = entry.bare_param or role == "param_diff"


def _build(
    entry: _Module,
    component: str,
    path: str,
    name: str,
    peft: _PeftConfig | None,
    low_rank: dict[str, LowRankUpdate],
    deltas: dict[str, torch.Tensor],
) -> None:
    if (entry.down is None) != (entry.up is None):
        have, miss = ("down", "up") if entry.up is None else ("up", "down")
        raise AdapterError(
            f"adapter {name!r}: {component}.{path} has a LoRA {have} but no {miss} ({entry.source})", param="adapters"
        )
    if entry.down is not None and entry.up is not None:
        if entry.down.dim() != 2 or entry.up.dim() != 2:
            raise AdapterError(
                f"adapter {name!r}: {component}.{path} LoRA down/up must be 2-D (linear layers), got "
                f"{tuple(entry.down.shape)} / {tuple(entry.up.shape)}",
                param="adapters",
            )
        alpha = entry.alpha
        if peft is not None:
            alpha = peft.alpha(path, int(entry.down.shape[0]))
        bias = entry.bias
        if bias is not None and alpha is not None:
            # PEFT's lora_B is a Linear with the bias inside, so the bias is scaled by alpha/r too.
            bias = bias * (alpha / int(entry.down.shape[0]))
        low_rank[path] = LowRankUpdate(entry.down, entry.up, alpha, bias)
    elif entry.bias is not None:
        raise AdapterError(f"adapter {name!r}: {component}.{path} has lora_B.bias without lora_A/lora_B", param="adapters")
    elif entry.alpha is not None:
        raise AdapterError(f"adapter {name!r}: {component}.{path} has an alpha but no LoRA", param="adapters")
    if entry.diff is not None:
        param = path if entry.bare_param else f"{path}.weight"
        if not (_is_norm(path) and not bool(entry.diff.any())):
            deltas[param] = entry.diff
    if entry.diff_b is not None and not (_is_norm(path) and not bool(entry.diff_b.any())):
        deltas[f"{path}.bias"] = entry.diff_b


def _is_norm(path: str) -> bool:
    return any(part.startswith("norm") for part in path.split("."))


@dataclass(frozen=True)
class _PeftConfig:
    """The parts of a PEFT ``LoraConfig`` that set a module's scale."""

    lora_alpha: float
    alpha_pattern: Mapping[str, float]
    use_rslora: bool

    def alpha(self, path: str, rank: int) -> float:
        """The alpha that makes ``alpha/rank`` PEFT's scale for ``path`` (``lora_alpha/√r`` under rsLoRA)."""
        lora_alpha = next((float(v) for p, v in self.alpha_pattern.items() if _peft_matches(p, path)), self.lora_alpha)
        if self.use_rslora:
            return lora_alpha / math.sqrt(rank) * rank
        return lora_alpha


def _peft_matches(pattern: str, path: str) -> bool:
    # PEFT's rule (tuners_utils): the pattern matches the module name or a dotted suffix of it.
    return re.match(rf"(.*\.)?({pattern.lstrip('^')})$", path) is not None


def _peft_config(metadata: Mapping[str, str], name: str) -> dict[str, _PeftConfig]:
    raw = metadata.get(PEFT_METADATA_KEY)
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise AdapterError(f"adapter {name!r}: metadata {PEFT_METADATA_KEY} is not JSON ({exc})", param="adapters") from exc
    out: dict[str, _PeftConfig] = {}
    components = {k.split(".", 1)[0] for k in config if "." in k}
    for component in components:
        fields = {k.split(".", 1)[1]: v for k, v in config.items() if k.startswith(f"{component}.")}
        if fields.get("use_dora"):
            raise AdapterError(f"adapter {name!r}: its PEFT config says use_dora; DoRA is not supported", param="adapters")
        if "lora_alpha" not in fields:
            continue
        out[component] = _PeftConfig(
            lora_alpha=float(fields["lora_alpha"]),
            alpha_pattern=dict(fields.get("alpha_pattern") or {}),
            use_rslora=bool(fields.get("use_rslora", False)),
        )
    return out
