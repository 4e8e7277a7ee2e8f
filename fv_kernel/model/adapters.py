"""Adapter files → :class:`~fv_kernel.compute.lora.AdapterWeights` per component (docs/adapters.md).

A card names its converter in ``ModelCard.adapter_format``; without one the kernel's
diffusers/PEFT converter :func:`convert_peft` reads the file. Every tensor of the file maps
onto an update or the converter raises :class:`~fv_kernel.compute.lora.AdapterKeyError`
naming it: nothing is dropped silently.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

import torch

from fv_kernel.card.refs import import_object
from fv_kernel.card.spec import AdapterRef, ModelCard
from fv_kernel.compute.lora import AdapterError, AdapterKeyError, AdapterWeights, LowRankUpdate

__all__ = ["AdapterConverter", "convert_peft", "converter_for", "combined_stack", "PEFT_METADATA_KEY"]

#: ``convert(state_dict, *, name, metadata) -> {component_id: AdapterWeights}``.
AdapterConverter = Callable[..., dict[str, AdapterWeights]]

#: The safetensors metadata entry where diffusers stores the PEFT ``LoraConfig`` of each component
#: (keys prefixed ``<component>.``: ``transformer.lora_alpha``, ``transformer.alpha_pattern``...).
PEFT_METADATA_KEY = "lora_adapter_metadata"

_PEFT_KEY = re.compile(
    r"^(?P<component>[A-Za-z0-9_]+)\.(?P<module>.+?)\."
    r"(?:(?P<part>lora_A|lora_B)(?:\.default)?\.(?P<leaf>weight|bias)|(?P<alpha>alpha))$"
)


def _peft_configs(metadata: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Each component's LoraConfig fields from diffusers' ``lora_adapter_metadata`` (empty without it)."""
    raw = metadata.get(PEFT_METADATA_KEY)
    if raw is None:
        return {}
    try:
        packed = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise AdapterError(f"metadata {PEFT_METADATA_KEY!r} is not JSON: {exc}", param="adapters") from None
    if not isinstance(packed, dict):
        raise AdapterError(f"metadata {PEFT_METADATA_KEY!r} must be a JSON object", param="adapters")
    configs: dict[str, dict[str, Any]] = {}
    for key, value in packed.items():
        component, _, field = str(key).partition(".")
        if field:
            configs.setdefault(component, {})[field] = value
    return configs


def _pattern_value(patterns: Mapping[str, Any], module: str) -> Any:
    # PEFT matches a pattern against the module's full name or a dotted suffix of it.
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return None


def _alpha(config: Mapping[str, Any], module: str) -> float | None:
    patterned = _pattern_value(config.get("alpha_pattern") or {}, module)
    if patterned is not None:
        return float(patterned)
    return None if config.get("lora_alpha") is None else float(config["lora_alpha"])


def convert_peft(state_dict: Mapping[str, torch.Tensor], *, name: str, metadata: Mapping[str, str]) -> dict[str, AdapterWeights]:
    """The diffusers/PEFT layout: ``<component>.<module>.lora_A.weight`` ([r, in]), ``.lora_B.weight``
    ([out, r]), optional ``.lora_B.bias`` and ``.alpha``.

    The scale is ``alpha/r`` with alpha from the module's ``.alpha`` entry, else from the
    component's PEFT config in the file's metadata (``alpha_pattern``, then ``lora_alpha``), else
    none (a scale of 1, as diffusers loads a file without either). A key of any other form, or a
    module with one half of its pair, raises :class:`AdapterKeyError` naming it.
    """
    configs = _peft_configs(metadata)
    for component, config in configs.items():
        if config.get("use_dora"):
            raise AdapterError(f"adapter {name!r}: component {component!r} is a DoRA adapter, which fv does not apply",
                               param="adapters")
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, tensor in state_dict.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            unknown.append(key)
            continue
        slot = "alpha" if match["alpha"] else f"{match['part']}.{match['leaf']}"
        parts.setdefault((match["component"], match["module"]), {})[slot] = tensor
    if unknown:
        raise AdapterKeyError(name, "(diffusers/PEFT layout)", sorted(unknown),
                              ["<component>.<module>.lora_A.weight", "<component>.<module>.lora_B.weight"])
    incomplete = sorted(
        f"{component}.{module}" for (component, module), p in parts.items() if "lora_A.weight" not in p or "lora_B.weight" not in p
    )
    if incomplete:
        raise AdapterKeyError(name, "(diffusers/PEFT layout)", [f"{m} (needs both lora_A.weight and lora_B.weight)" for m in incomplete], [])
    stray_bias = sorted(f"{c}.{m}.lora_A.bias" for (c, m), p in parts.items() if "lora_A.bias" in p)
    if stray_bias:
        raise AdapterKeyError(name, "(diffusers/PEFT layout)", stray_bias, [])
    by_component: dict[str, dict[str, LowRankUpdate]] = {}
    for (component, module), p in sorted(parts.items()):
        alpha_entry = p.get("alpha")
        alpha = float(alpha_entry.float().item()) if alpha_entry is not None else _alpha(configs.get(component, {}), module)
        bias = p.get("lora_B.bias")
        if bias is not None and alpha is not None:
            # PEFT's lora_B is a Linear with the bias inside, so the bias is scaled by alpha/r too.
            bias = bias * (alpha / int(p["lora_A.weight"].shape[0]))
        by_component.setdefault(component, {})[module] = LowRankUpdate(
            down=p["lora_A.weight"], up=p["lora_B.weight"], alpha=alpha, bias=bias,
        )
    return {component: AdapterWeights(name, component, low_rank=updates) for component, updates in by_component.items()}


def converter_for(card: ModelCard) -> AdapterConverter:
    """The card's adapter converter (``adapter_format``), or :func:`convert_peft`."""
    if card.adapter_format is None:
        return convert_peft
    converter = import_object(card.adapter_format)
    if not callable(converter):
        raise TypeError(f"card {card.model_id!r}: adapter_format {card.adapter_format!r} is not callable")
    return converter  # type: ignore[no-any-return]


def combined_stack(card: ModelCard, request: Any) -> list[tuple[str, AdapterRef]]:
    """The stack a request runs: the card's default stack (``recipe.adapters``), then the
    request's own adapters; a request entry naming a default adapter replaces it in place (its
    strength; 0 turns it off). Each entry comes with the field it came from (for errors)."""
    entries: list[tuple[str, AdapterRef]] = [
        (f"recipe.adapters[{i}].name", ref) for i, ref in enumerate(card.recipe.adapters)
    ]
    position = {ref.name: i for i, (_, ref) in enumerate(entries)}
    for i, ref in enumerate(request.adapters):
        param = f"adapters[{i}].name"
        if ref.name in position:
            entries[position[ref.name]] = (param, ref)
        else:
            position[ref.name] = len(entries)
            entries.append((param, ref))
    return entries
