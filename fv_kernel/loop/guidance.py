"""Guidance policies: the algebra of classifier-free guidance, separate from how branches run.

Design §5.3: a policy fixes the *algebra* — which branches a step needs (``branches``)
and how their outputs combine (``combine``) — while the step body fixes the *numeric
space* (velocity for Wan/Cosmos flow models, x0 for an EDM body) and the dispatch (one
batched forward, sequential forwards, or a cfg-parallel split across ranks). The
helpers at the bottom (``stack_branches`` / ``split_branches`` / ``run_branches``) make
batched and sequential dispatch interchangeable for the same ``combine``.

Policies are frozen pydantic configs and hold no per-request state: everything that
varies per step comes in through ``combine``'s arguments (``step_index``).

``is_distribution_altering``: True when ``combine`` can return something other than the
plain conditional prediction, i.e. the loop then samples from a guided distribution
rather than the model's own conditional one. Consumers that need on-policy samples of
the model (RL likelihoods, behaviour records, distilled checkpoints trained without
CFG) check it. Embedded guidance is *not* distribution-altering in this sense: the scale
is a model input (``forward_kwargs``) and the combine is the identity.
"""

from __future__ import annotations

import abc
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny

__all__ = [
    "COND",
    "UNCOND",
    "GuidanceError",
    "GuidancePolicy",
    "StandardCFG",
    "CFGZeroStar",
    "GuidanceRescale",
    "CFGNormalize",
    "EmbeddedGuidance",
    "ConditionalOnly",
    "builtin_guidance_policies",
    "zero_star_scale",
    "rescale_to_reference_std",
    "stack_branches",
    "split_branches",
    "run_branches",
]

COND = "cond"
UNCOND = "uncond"


class GuidanceError(ValueError):
    """A guidance policy or branch dispatch was given inconsistent inputs."""


def _check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise GuidanceError(f"guidance scale must be a finite number, got {scale!r}")
    return float(scale)


class GuidancePolicy(BaseModel, abc.ABC):
    """Base class of guidance policies (a frozen pydantic config)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: ClassVar[str]

    @property
    @abc.abstractmethod
    def is_distribution_altering(self) -> bool:
        """See the module docstring."""

    @abc.abstractmethod
    def branches(self, scale: float) -> tuple[str, ...]:
        """The forward branches a step needs at this scale, in dispatch order."""

    @abc.abstractmethod
    def combine(self, outputs: Mapping[str, torch.Tensor], scale: float, *, step_index: int) -> torch.Tensor:
        """Fold the branch outputs (keys = ``branches(scale)``) into one prediction."""

    def forward_kwargs(self, scale: float) -> dict[str, float]:
        """Extra keyword arguments the model forward takes from the policy (embedded guidance)."""
        return {}

    def config_signature(self) -> str:
        fields = self.model_dump(mode="json")
        return f"{self.name}:{json.dumps(fields, sort_keys=True, separators=(',', ':'))}"

    def _outputs(self, outputs: Mapping[str, torch.Tensor], scale: float) -> list[torch.Tensor]:
        """The outputs of ``branches(scale)`` in order, checked for presence and equal shapes."""
        names = self.branches(scale)
        missing = [n for n in names if n not in outputs]
        if missing:
            raise GuidanceError(f"{self.name} at scale {scale} needs branches {names}, missing {missing}")
        tensors = [outputs[n] for n in names]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise GuidanceError(f"branch outputs must share one shape, got {dict(zip(names, shapes))}")
        return tensors


class StandardCFG(GuidancePolicy):
    """Classifier-free guidance ``uncond + g * (cond - uncond)``.

    ``active_when`` picks when the uncond pass runs at all (otherwise the step is the
    conditional prediction and the uncond forward is skipped): ``"above_one"`` is Wan's
    ``guidance_scale > 1``; ``"not_one"`` is Cosmos 3's and diffusers guiders'
    ``guidance_scale != 1``.
    """

    name: ClassVar[str] = "cfg"

    active_when: Literal["above_one", "not_one"] = "above_one"

    @property
    def is_distribution_altering(self) -> bool:
        return True

    def is_active(self, scale: float) -> bool:
        scale = _check_scale(scale)
        return scale > 1.0 if self.active_when == "above_one" else scale != 1.0

    def branches(self, scale: float) -> tuple[str, ...]:
        return (COND, UNCOND) if self.is_active(scale) else (COND,)

    def combine(self, outputs: Mapping[str, torch.Tensor], scale: float, *, step_index: int) -> torch.Tensor:
        if not self.is_active(scale):
            return self._outputs(outputs, scale)[0]
        cond, uncond = self._outputs(outputs, scale)
        return uncond + scale * (cond - uncond)


def zero_star_scale(cond: torch.Tensor, uncond: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """CFG-Zero*'s per-sample projection ``<cond, uncond> / (||uncond||^2 + eps)``.

    Computed in fp32 over all non-batch dims, returned in ``cond``'s dtype shaped to
    broadcast against it (``(B, 1, ..., 1)``).
    """
    if cond.ndim < 2:
        raise GuidanceError(f"CFG-Zero* needs a leading batch dim, got shape {tuple(cond.shape)}")
    c, u = cond.flatten(1).float(), uncond.flatten(1).float()
    st = (c * u).sum(dim=1, keepdim=True) / ((u * u).sum(dim=1, keepdim=True) + eps)
    return st.to(cond.dtype).view(-1, *(1,) * (cond.ndim - 1))


class CFGZeroStar(StandardCFG):
    """CFG-Zero* (arXiv 2503.18886), as diffusers' ``ClassifierFreeZeroStarGuidance``.

    ``st = zero_star_scale(cond, uncond)``; guided = ``uncond*st + g*(cond - uncond*st)``;
    for the first ``zero_init_steps`` steps the prediction is zero (the paper suggests the
    first ~4% of steps). Zero-init takes precedence over an inactive scale, as in diffusers.
    """

    name: ClassVar[str] = "cfg_zero_star"

    zero_init_steps: Annotated[int, Field(ge=0)] = 1
    eps: Annotated[float, Field(gt=0)] = 1e-8

    def combine(self, outputs: Mapping[str, torch.Tensor], scale: float, *, step_index: int) -> torch.Tensor:
        tensors = self._outputs(outputs, scale)
        if step_index < self.zero_init_steps:
            return torch.zeros_like(tensors[0])
        if len(tensors) == 1:
            return tensors[0]
        cond, uncond = tensors
        uncond = uncond * zero_star_scale(cond, uncond, self.eps)
        return uncond + scale * (cond - uncond)


def rescale_to_reference_std(guided: torch.Tensor, reference: torch.Tensor, phi: float) -> torch.Tensor:
    """diffusers' ``rescale_noise_cfg`` (arXiv 2305.08891 §3.4): match ``guided``'s per-sample std
    (over non-batch dims, unbiased) to ``reference``'s, then blend by ``phi``.

    One guard diffusers lacks: where ``guided`` has zero std (e.g. CFG-Zero*'s zero-init
    output) the ratio is taken as 1 instead of producing inf/NaN.
    """
    dims = list(range(1, guided.ndim))
    std_ref = reference.std(dim=dims, keepdim=True)
    std_guided = guided.std(dim=dims, keepdim=True)
    ratio = torch.where(std_guided > 0, std_ref / std_guided, torch.ones_like(std_guided))
    return phi * (guided * ratio) + (1 - phi) * guided


class GuidanceRescale(GuidancePolicy):
    """Wraps a policy and applies guidance rescale (``phi`` = diffusers' ``guidance_rescale``).

    Applied only when the inner policy actually guides (more than one branch): rescaling
    the conditional prediction against itself is a no-op up to rounding.
    """

    name: ClassVar[str] = "rescale"

    inner: SerializeAsAny[GuidancePolicy]
    phi: Annotated[float, Field(ge=0.0, le=1.0)] = 0.7

    @property
    def is_distribution_altering(self) -> bool:
        return self.inner.is_distribution_altering

    def branches(self, scale: float) -> tuple[str, ...]:
        return self.inner.branches(scale)

    def forward_kwargs(self, scale: float) -> dict[str, float]:
        return self.inner.forward_kwargs(scale)

    def combine(self, outputs: Mapping[str, torch.Tensor], scale: float, *, step_index: int) -> torch.Tensor:
        guided = self.inner.combine(outputs, scale, step_index=step_index)
        if self.phi == 0.0 or len(self.branches(scale)) < 2:
            return guided
        return rescale_to_reference_std(guided, outputs[COND], self.phi)

    def config_signature(self) -> str:
        return f"{self.name}:{{\"phi\":{json.dumps(self.phi)}}}[{self.inner.config_signature()}]"


class CFGNormalize(GuidancePolicy):
    """Wraps a policy and rescales the guided prediction to the conditional one's norm along
    ``dim``: ``guided * ||cond|| / ||guided||`` — diffusers' QwenImage-Layered ``cfg_normalize``.

    (Cosmos 3 has a ``normalize_cfg`` option too; its exact formula was not available to
    check, so this policy does not claim to be it.)
    """

    name: ClassVar[str] = "cfg_normalize"

    inner: SerializeAsAny[GuidancePolicy]
    dim: int = -1

    @property
    def is_distribution_altering(self) -> bool:
        return self.inner.is_distribution_altering

    def branches(self, scale: float) -> tuple[str, ...]:
        return self.inner.branches(scale)

    def forward_kwargs(self, scale: float) -> dict[str, float]:
        return self.inner.forward_kwargs(scale)

    def combine(self, outputs: Mapping[str, torch.Tensor], scale: float, *, step_index: int) -> torch.Tensor:
        guided = self.inner.combine(outputs, scale, step_index=step_index)
        if len(self.branches(scale)) < 2:
            return guided
        cond_norm = torch.norm(outputs[COND], dim=self.dim, keepdim=True)
        guided_norm = torch.norm(guided, dim=self.dim, keepdim=True)
        return guided * (cond_norm / guided_norm)

    def config_signature(self) -> str:
        return f"{self.name}:{{\"dim\":{self.dim}}}[{self.inner.config_signature()}]"


class EmbeddedGuidance(GuidancePolicy):
    """Guidance-distilled models (Flux-style): one conditional forward that takes the scale as
    the keyword argument ``kwarg``; the combine is the identity."""

    name: ClassVar[str] = "embedded"

    kwarg: Annotated[str, Field(min_length=1)] = "guidance"

    @property
    def is_distribution_altering(self) -> bool:
        return False

    def branches(self, scale: float) -> tuple[str, ...]:
        _check_scale(scale)
        return (COND,)

    def forward_kwargs(self, scale: float) -> dict[str, float]:
        return {self.kwarg: _check_scale(scale)}

    def combine(self, outputs: Mapping[str, torch.Tensor], scale: float, *, step_index: int) -> torch.Tensor:
        return self._outputs(outputs, scale)[0]


class ConditionalOnly(GuidancePolicy):
    """No guidance: the conditional prediction as is (distilled few-step loops, on-policy RL rollouts)."""

    name: ClassVar[str] = "none"

    @property
    def is_distribution_altering(self) -> bool:
        return False

    def branches(self, scale: float) -> tuple[str, ...]:
        _check_scale(scale)
        return (COND,)

    def combine(self, outputs: Mapping[str, torch.Tensor], scale: float, *, step_index: int) -> torch.Tensor:
        return self._outputs(outputs, scale)[0]


def builtin_guidance_policies() -> dict[str, type[GuidancePolicy]]:
    """The kernel's guidance policies by name (a fresh dict; no module-level registry)."""
    classes = (StandardCFG, CFGZeroStar, GuidanceRescale, CFGNormalize, EmbeddedGuidance, ConditionalOnly)
    return {cls.name: cls for cls in classes}


# --------------------------------------------------------------------------- dispatch


def stack_branches(inputs_per_branch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-branch inputs (in branch order) along the batch dim for one forward."""
    if not inputs_per_branch:
        raise GuidanceError("stack_branches needs at least one branch input")
    shapes = {tuple(t.shape[1:]) for t in inputs_per_branch}
    if any(t.ndim == 0 for t in inputs_per_branch) or len(shapes) > 1:
        raise GuidanceError(
            "branch inputs must have a batch dim and equal trailing shapes to be batched, got "
            f"{[tuple(t.shape) for t in inputs_per_branch]} (pad per-branch text to one length first)"
        )
    return torch.cat(list(inputs_per_branch), dim=0)


def split_branches(batched_out: torch.Tensor, branches: Sequence[str]) -> dict[str, torch.Tensor]:
    """Inverse of ``stack_branches`` on the forward's output: ``{branch: chunk}``."""
    n = len(branches)
    if n == 0 or len(set(branches)) != n:
        raise GuidanceError(f"branches must be non-empty and distinct, got {tuple(branches)}")
    if batched_out.ndim == 0 or batched_out.shape[0] % n:
        raise GuidanceError(f"batched output of shape {tuple(batched_out.shape)} cannot split into {n} branches")
    return dict(zip(branches, batched_out.chunk(n, dim=0)))


def run_branches(
    forward: Callable[..., torch.Tensor],
    inputs_per_branch: Mapping[str, Mapping[str, Any]],
    *,
    batched: bool,
) -> dict[str, torch.Tensor]:
    """Run ``forward(**kwargs)`` for each branch, either as one batched call or sequentially.

    ``inputs_per_branch`` maps branch name → forward kwargs (same keys in every branch).
    Batched: tensors with a batch dim are stacked; 0-d tensors and non-tensors must be
    equal across branches and are passed once. The result is ``{branch: output}`` either way.
    """
    names = list(inputs_per_branch)
    if not names:
        raise GuidanceError("run_branches needs at least one branch")
    if not batched or len(names) == 1:
        return {name: forward(**inputs_per_branch[name]) for name in names}
    keys = set(inputs_per_branch[names[0]])
    for name in names[1:]:
        if set(inputs_per_branch[name]) != keys:
            raise GuidanceError(f"branch {name!r} kwargs {sorted(inputs_per_branch[name])} != {sorted(keys)}")
    kwargs: dict[str, Any] = {}
    for key in keys:
        values = [inputs_per_branch[name][key] for name in names]
        first = values[0]
        if isinstance(first, torch.Tensor) and first.ndim > 0:
            kwargs[key] = stack_branches(values)
        elif all(_same_value(first, v) for v in values[1:]):
            kwargs[key] = first
        else:
            raise GuidanceError(f"kwarg {key!r} differs across branches and cannot be batched")
    return split_branches(forward(**kwargs), names)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)
