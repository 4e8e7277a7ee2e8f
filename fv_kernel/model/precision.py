"""Precision paths at deploy and load (docs/precision.md): which path an instance runs, and
which of a component's linears it quantizes.

:func:`select_precision_path` resolves a deployment's ``precision_path`` (a name, ``auto`` or
None) against the card's ``PrecisionContract.paths`` and ``RecipeSpec.assumes_precision``, and
the recorded measurements in ``compute.parity_record``. :func:`fp8_target_paths` resolves the
card's ``fp8_targets`` globs on a loaded module, and :func:`apply_precision_path` swaps those
linears for ``Fp8Linear`` s: what a family's loader calls once a component's weights are in.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
from torch import nn

from fv_kernel.card.spec import (
    FP8_ATTENTION_PATHS,
    FP8_LINEAR_PATHS,
    PRECISION_PATHS,
    ModelCard,
    PrecisionPathVerdict,
    TierParityRecord,
)
from fv_kernel.compute.compile import load_parity_record
from fv_kernel.compute.fp8 import Fp8Kernel, Fp8Linear, quantize_linears
from fv_kernel.errors import InvalidRequest, RecipeMismatch
from fv_kernel.model.options import InstanceOptions

__all__ = [
    "PrecisionPathSelection",
    "select_precision_path",
    "fp8_target_paths",
    "apply_precision_path",
    "FP8_ATTENTION_BACKEND",
    "uses_fp8_attention",
    "stores_fp8",
    "prepare_fp8_storage",
]

log = logging.getLogger("fv.card")

#: The attention backend the fp8 attention paths run (the FP8 attention driver's registered name).
FP8_ATTENTION_BACKEND = "fp8"

_OVERRIDE = "deploy config 'override_recipe: true', fv generate --override-recipe"


@dataclass(frozen=True)
class PrecisionPathSelection:
    """What :func:`select_precision_path` decided, and why."""

    #: The path the instance runs.
    path: str
    #: What the deployment asked (None: the card's own).
    asked: str | None
    #: The contract verdict of each listed path that was judged (``auto``: all; a name: that one).
    verdicts: Mapping[str, PrecisionPathVerdict]
    #: One line: why this path.
    reason: str
    #: True when the path departs from the recipe's assumed path under ``allow_recipe_mismatch``.
    recipe_overridden: bool = False


def _allowed(card: ModelCard) -> str:
    return ", ".join(card.precision.allowed_paths)


def select_precision_path(card: ModelCard, options: InstanceOptions) -> PrecisionPathSelection:
    """The precision path an instance of ``card`` built with ``options`` runs.

    - None: the path the recipe assumes (``assumes_precision`` naming a path), else ``native``.
    - A name: that path; one the card does not list is an ``InvalidRequest`` naming
      ``precision_path`` and the allowed paths; a path other than the recipe's assumed one is a
      ``RecipeMismatch`` unless ``allow_recipe_mismatch``. A listed path whose recorded
      measurement fails (or is missing) runs anyway, with a warning: the name is the user's choice.
    - ``auto``: the recipe's assumed path if it has one; else, of the listed paths whose recorded
      measurement (``compute.parity_record``) passes the path's contract and was timed on this
      device type faster than native, the fastest; else ``native``.
    """
    asked = options.precision_path
    precision = options.precision or card.precision.default
    assumed = card.recipe.assumed_path
    listed = card.precision.paths
    if asked is not None and asked != "auto" and asked not in PRECISION_PATHS:
        raise InvalidRequest("precision_path", f"{asked!r} is not a precision path", allowed=[*PRECISION_PATHS, "auto"])
    if asked not in (None, "auto", "native") and asked not in listed:
        raise InvalidRequest(
            "precision_path", f"card {card.model_id!r} does not list precision path {asked!r} in precision.paths",
            allowed=_allowed(card),
        )
    compute = options.compute
    record = (load_parity_record(compute.parity_record) if compute is not None and compute.parity_record
              else TierParityRecord())

    def verdict(path: str) -> PrecisionPathVerdict:
        return listed[path].check(record.find_path(path, card.model_id, precision), model_id=card.model_id,  # type: ignore[index]
                                  precision=precision, defaults=card.capabilities.defaults)

    if asked is None or (asked == "auto" and assumed is not None):
        path = assumed or "native"
        why = f"the recipe ({card.recipe.method!r}) assumes {assumed!r}" if assumed else "the card's default"
        return PrecisionPathSelection(path=path, asked=asked, verdicts=MappingProxyType({}), reason=why)
    if asked == "auto":
        device_type = torch.device(options.device).type
        verdicts = {p: verdict(p) for p in listed}
        timed = []
        for p, v in verdicts.items():
            m = record.find_path(p, card.model_id, precision)
            if v.passed and m is not None and m.device == device_type and (m.speedup or 0.0) > 1.0:
                timed.append((m.speedup, p))
        if not timed:
            reasons = "; ".join(v.reason for v in verdicts.values() if not v.passed) or (
                f"no listed path passing its contract was timed faster than native on {device_type}")
            return PrecisionPathSelection(path="native", asked=asked, verdicts=MappingProxyType(verdicts),
                                          reason=f"auto: native ({reasons or 'the card lists no path'})")
        speedup, path = max(timed)
        return PrecisionPathSelection(path=path, asked=asked, verdicts=MappingProxyType(verdicts), reason=(
            f"auto: {path!r}, {speedup:.2f}x native on {device_type}; {verdicts[path].reason}"))
    overridden = False
    if assumed is not None and asked != assumed:
        if not options.allow_recipe_mismatch:
            raise RecipeMismatch(
                "precision_path", model_id=card.model_id, method=card.recipe.method,
                assumes=f"precision path {assumed!r}",
                asked=f"precision path {asked!r} (an explicit override deploys it anyway: {_OVERRIDE})",
            )
        log.warning("card %r (recipe %r) assumes precision path %r; deploying it on %r because the recipe was "
                    "overridden", card.model_id, card.recipe.method, assumed, asked)
        overridden = True
    if asked == "native":
        return PrecisionPathSelection(path="native", asked=asked, verdicts=MappingProxyType({}),
                                      reason="asked for by name", recipe_overridden=overridden)
    judged = verdict(asked)
    if not judged.passed and asked != assumed:
        log.warning("precision path %r was asked for by name and runs, outside its contract: %s", asked, judged.reason)
    return PrecisionPathSelection(path=asked, asked=asked, verdicts=MappingProxyType({asked: judged}),
                                  reason=f"asked for by name; {judged.reason}", recipe_overridden=overridden)


def fp8_target_paths(card: ModelCard, component: str, module: nn.Module) -> list[str]:
    """The paths of ``module``'s linears that the card's ``fp8_targets[component]`` globs match
    (``fnmatch``, in module order). A glob matching no linear is an ``InvalidRequest`` naming
    ``precision.fp8_targets`` and some of the linears there are: a renamed module must not
    silently leave its layers in full precision. A component with no globs has no targets."""
    globs = card.precision.fp8_targets.get(component, ())
    # Fp8Linear counts: a component loaded from an fp8 card already holds its targets quantized.
    linears = [name for name, m in module.named_modules() if isinstance(m, (nn.Linear, Fp8Linear)) and name]
    unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(name, g) for name in linears)]
    if unmatched:
        raise InvalidRequest(
            "precision.fp8_targets",
            f"card {card.model_id!r}: glob(s) {unmatched} match no linear of component {component!r}",
            allowed=f"globs over its linears, e.g. {', '.join(linears[:6]) or '(it has none)'}",
        )
    return [name for name in linears if any(fnmatch.fnmatchcase(name, g) for g in globs)]


def apply_precision_path(card: ModelCard, component: str, module: nn.Module, path: str, *,
                         kernel: str | Fp8Kernel = "torch") -> list[str]:
    """Quantize ``component``'s fp8 targets in place for ``path`` (``Fp8Linear``, per-channel e4m3
    weights; mode ``fp8_dynamic`` on ``fp8_dynamic``/``fp8_all``) and return their paths. Targets
    already ``Fp8Linear`` (an fp8 card's weights) are kept as loaded, their mode and kernel set;
    paths without fp8 linears change nothing."""
    if path not in PRECISION_PATHS:
        raise InvalidRequest("precision_path", f"{path!r} is not a precision path", allowed=PRECISION_PATHS)
    mode = FP8_LINEAR_PATHS.get(path)
    if mode is None:
        return []
    targets = fp8_target_paths(card, component, module)
    for name in targets:
        existing = module.get_submodule(name)
        if isinstance(existing, Fp8Linear):
            existing.mode = mode
            existing.kernel = kernel
    fresh = [name for name in targets if not isinstance(module.get_submodule(name), Fp8Linear)]
    quantize_linears(module, fresh, mode=mode, kernel=kernel)  # type: ignore[arg-type]
    return targets


def stores_fp8(card: ModelCard, component: str) -> bool:
    """Whether ``component``'s checkpoint holds its fp8 targets already quantized (a card
    ``fv quantize`` wrote: ``recipe.quantized_from``)."""
    quantized = card.recipe.quantized_from
    return quantized is not None and component in quantized.components


def prepare_fp8_storage(card: ModelCard, component: str, module: nn.Module, path: str, *,
                        kernel: str | Fp8Kernel = "torch") -> list[str]:
    """Before loading a checkpoint that :func:`stores_fp8`: replace ``component``'s fp8 targets by
    empty ``Fp8Linear`` s (e4m3 ``weight``, fp32 ``weight_scale``) so the stored tensors load
    into them as they are, nothing quantized again. A path without fp8 linears (``native`` under a
    recipe override) runs them as ``fp8_weights``: the weights are what the file holds. Returns
    the paths replaced (none when the checkpoint stores no fp8)."""
    quantized = card.recipe.quantized_from
    if quantized is None or component not in quantized.components:
        return []
    mode = FP8_LINEAR_PATHS.get(path, "fp8_weights")
    targets = fp8_target_paths(card, component, module)
    for name in targets:
        linear = module.get_submodule(name)
        if isinstance(linear, Fp8Linear):
            continue
        assert isinstance(linear, nn.Linear)
        parent_path, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        setattr(parent, leaf, Fp8Linear(
            linear.in_features, linear.out_features, bias=linear.bias is not None, mode=mode,  # type: ignore[arg-type]
            per_channel=quantized.per_channel, kernel=kernel, device=linear.weight.device,
            bias_dtype=linear.bias.dtype if linear.bias is not None else torch.float32))
    return targets


def uses_fp8_attention(path: str) -> bool:
    """Whether ``path`` runs attention through the fp8 attention driver."""
    return path in FP8_ATTENTION_PATHS
