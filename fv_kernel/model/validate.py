"""Validate a request against a card before any compute (design §4.2: the recipe's teeth).

:func:`resolve_request` fills the card's defaults, checks shapes against the card's
capabilities and the deployment's limits, enforces ``RecipeSpec.assumes_loop`` /
``assumes_precision``, resolves the adapter stack (the card's default, then the request's;
unknown names, stack size, distilled adapters' loop and step count), and checks
``output.modalities`` against what the card's program returns. Every failure is a typed
error naming the field.
"""

from __future__ import annotations

import logging
import math

from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field

from fv_kernel.cache.adapters import AdapterInfo, AdapterRegistry
from fv_kernel.card.spec import ModelCard
from fv_kernel.model.adapters import combined_stack
from fv_kernel.errors import InvalidRequest, RecipeMismatch
from fv_kernel.card.recipe import (
    OVERRIDE_HINT, check_envelope, check_recipe_attention, describe_loop, sampler_short_name, select_denoise_loop,
)
from fv_kernel.loop.samplers import registered_samplers
from fv_kernel.request.request import _REQUIRED_PARTS, DiffusionParams, Request
from fv_kernel.request.types import TaskType

from fv_kernel.model.instance import ModelInstance

__all__ = [
    "RequestLimits", "resolve_request", "resolve_for_instance", "select_denoise_loop", "describe_loop", "allowed_samplers",
    "reasoner_loops", "check_recipe_attention", "frames_for_seconds", "check_envelope", "OPENAI_SECONDS",
]

log = logging.getLogger("fv.card")

#: The durations the OpenAI video API's ``seconds`` takes (``"4"``, ``"8"``, ``"12"``).
OPENAI_SECONDS = (4, 8, 12)

_DIFFUSION_TASKS = frozenset(TaskType) - {TaskType.TEXT_GENERATION}


class RequestLimits(BaseModel):
    """Deployment-wide caps on what one request may ask for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_frames: int | None = Field(default=None, gt=0)
    max_pixels: int | None = Field(default=None, gt=0)
    max_steps: int | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, gt=0)


def allowed_samplers(card: ModelCard, registered: Iterable[str] = ()) -> list[str]:
    """The samplers a request may name on ``card``: its denoise loops' samplers, plus the
    ``registered`` ones (a deployment's) unless the recipe fixes the loop."""
    loops = card.denoise_loops()
    assumed_id = card.recipe.assumes_loop
    if assumed_id is not None and assumed_id in loops:
        binding = loops[assumed_id].sampler
        return [sampler_short_name(binding.name)] if binding is not None else []
    bound = {sampler_short_name(s.sampler.name) for s in loops.values() if s.sampler is not None}
    return sorted(bound | ({sampler_short_name(name) for name in registered} if loops else set()))


def _check_sampler(card: ModelCard, request: Request, samplers: Iterable[str] | None) -> None:
    asked = request.diffusion.sampler
    if asked is None or not card.denoise_loops():
        return
    if samplers is None:
        samplers = registered_samplers()
    allowed = allowed_samplers(card, samplers)
    if sampler_short_name(asked) not in allowed:
        raise InvalidRequest(
            "sampler", f"card {card.model_id!r} has no denoise loop with sampler {asked!r}, and no enabled plugin registers it",
            allowed=allowed,
        )


def _check_precision(card: ModelCard, request: Request, allow_recipe_mismatch: bool) -> None:
    if request.precision is None:
        return
    assumed = card.recipe.assumed_dtype
    if assumed is not None and request.precision != assumed and not allow_recipe_mismatch:
        raise RecipeMismatch(
            "precision", model_id=card.model_id, method=card.recipe.method,
            assumes=f"precision {assumed!r}", asked=f"precision {request.precision!r}",
        )
    if request.precision not in card.precision.supported:
        raise InvalidRequest(
            "precision", f"card {card.model_id!r} does not run in {request.precision!r}",
            allowed=sorted(card.precision.supported),
        )


def reasoner_loops(card: ModelCard) -> list[str]:
    """The card's autoregressive decode loops: what rewrites a prompt (``prompt_upsampling``)."""
    return sorted(loop_id for loop_id, spec in card.loops.items() if spec.kind == "ar_decode")


def _check_text(card: ModelCard, request: Request) -> None:
    if "text" in _REQUIRED_PARTS[request.task] and not (request.text("prompt") or "").strip():
        raise InvalidRequest("prompt", f"task {request.task.value!r} needs a prompt; it is empty", allowed="non-blank text")
    if request.prompt_upsampling and not reasoner_loops(card):
        raise InvalidRequest(
            "prompt_upsampling",
            f"card {card.model_id!r} has no reasoner (an ar_decode loop) to rewrite the prompt",
            allowed="omit it, or a card with an ar_decode loop",
        )


def _check_shape(card: ModelCard, filled: DiffusionParams) -> None:
    """The card's declared bounds on steps, fps and the token grid."""
    caps = card.capabilities
    if caps.max_steps is not None and filled.steps is not None and filled.steps > caps.max_steps:
        raise InvalidRequest("steps", f"{filled.steps} exceeds the maximum of card {card.model_id!r}", allowed=f"1..{caps.max_steps}")
    if filled.fps is not None and (
        (caps.min_fps is not None and filled.fps < caps.min_fps) or (caps.max_fps is not None and filled.fps > caps.max_fps)
    ):
        low = f"{caps.min_fps:g}" if caps.min_fps is not None else "0 (exclusive)"
        high = f"{caps.max_fps:g}" if caps.max_fps is not None else "any"
        raise InvalidRequest("fps", f"{filled.fps:g} is outside the frame-rate range of card {card.model_id!r}", allowed=f"{low}..{high}")
    rule = caps.token_grid
    if rule is None or filled.frames is None or filled.height is None or filled.width is None:
        return
    grid = rule.grid(filled.frames, filled.height, filled.width)
    for axis, (field, tokens) in enumerate(zip(("frames", "height", "width"), grid)):
        if tokens > rule.max_per_axis:
            limit = rule.max_frames if axis == 0 else rule.max_side
            raise InvalidRequest(
                field,
                f"{filled.frames} frames at {filled.width}x{filled.height} make a token grid of {grid} on "
                f"{card.model_id!r}, beyond its positional table of {rule.max_per_axis} per axis",
                allowed=f"{field} <= {limit}",
            )


def _check_modalities(card: ModelCard, request: Request) -> None:
    asked = request.output.modalities
    returns = card.artifact_kinds(request.task)
    if asked is None or returns is None:
        return
    missing = sorted(asked - returns)
    if missing:
        raise InvalidRequest(
            "output.modalities",
            f"card {card.model_id!r} returns no {', '.join(missing)} for {request.task.value!r}",
            allowed=sorted(returns),
        )


def _resolve_adapters(
    card: ModelCard, request: Request, registry: AdapterRegistry | None,
) -> tuple[Request, list[tuple[str, AdapterInfo]]]:
    """The request with its whole stack (card defaults, then its own) pinned to the registered
    versions, and the active adapters (nonzero strength) with the field each came from."""
    stack = combined_stack(card, request)
    if not stack:
        return request, []
    if registry is None or not registry.settings.enabled:
        param = stack[0][0].removesuffix(".name")
        where = "card's default stack (recipe.adapters) names" if param.startswith("recipe.") else "request names"
        raise InvalidRequest(
            param, f"the {where} adapter {stack[0][1].name!r}, but this deployment has adapters disabled",
            allowed="no adapters, or a deployment with an adapters: section",
        )
    pinned, active = [], []
    for param, ref in stack:
        info = registry.get(ref.name, ref.version, param=param)
        foreign = sorted(set(info.components) - set(card.components))
        if foreign:
            raise InvalidRequest(
                param, f"adapter {ref.name!r} changes components {foreign} that card {card.model_id!r} does not have",
                allowed=f"adapters for components {sorted(card.components)}",
            )
        pinned.append(ref.model_copy(update={"version": info.version}))
        if ref.scale != 0:
            active.append((param, info))
    k = registry.settings.max_stack
    if len(active) > k:
        raise InvalidRequest("adapters", f"the stack has {len(active)} adapters (the card's defaults included)",
                             allowed=f"at most {k} (adapters.max_stack)")
    # The defaults are pinned too (re-resolving gives the same stack: a request entry replaces the
    # default of its name in place), so no step of this request sees another version.
    return request.with_updates(adapters=tuple(pinned)), active


def _distilled_defaults(card: ModelCard, request: Request, active: list[tuple[str, AdapterInfo]]) -> Request:
    """A distilled adapter's loop and step count fill what the request leaves out."""
    d = request.diffusion
    for param, info in active:
        if info.assumes_loop is not None and info.assumes_loop not in card.loops:
            raise InvalidRequest(
                param, f"adapter {info.name!r} assumes loop {info.assumes_loop!r}, which card {card.model_id!r} does not have",
                allowed=sorted(card.loops),
            )
        if info.assumes_steps is not None and d.steps is None:
            d = d.model_copy(update={"steps": info.assumes_steps})
        if info.assumes_loop is not None and d.sampler is None:
            binding = card.loops[info.assumes_loop].sampler
            if binding is not None:
                d = d.model_copy(update={"sampler": binding.name})
    return request if d is request.diffusion else request.with_updates(diffusion=d)


def _check_distilled(
    card: ModelCard, request: Request, loop_id: str | None, active: list[tuple[str, AdapterInfo]], allow_recipe_mismatch: bool,
) -> None:
    """A distilled adapter runs only in the loop and step count it was distilled for."""
    override = "an explicit override runs it anyway: deploy config 'override_recipe: true', fv generate --override-recipe"
    steps = request.diffusion.steps
    for _, info in active:
        subject = f"adapter {info.name!r}"
        mismatches = []  # (field, what the adapter assumes, why, what the request asked)
        if info.assumes_loop is not None and loop_id is not None and loop_id != info.assumes_loop:
            mismatches.append(("adapters", describe_loop(card.loops[info.assumes_loop]), "", describe_loop(card.loops[loop_id])))
        if info.assumes_steps is not None and steps is not None and steps != info.assumes_steps:
            mismatches.append(("steps", f"{info.assumes_steps} steps", " (it is distilled for them)", f"{steps} steps"))
        for param, assumes, why, asked in mismatches:
            if allow_recipe_mismatch:
                log.warning("%s assumes %s; running %s because the recipe was overridden", subject, assumes, asked)
                continue
            raise RecipeMismatch(
                param, model_id=card.model_id, method=card.recipe.method, subject=subject,
                assumes=assumes + why, asked=f"{asked} ({override})",
            )


def resolve_request(
    card: ModelCard,
    request: Request,
    limits: RequestLimits | None = None,
    *,
    allow_recipe_mismatch: bool = False,
    samplers: Iterable[str] | None = None,
    adapters: AdapterRegistry | None = None,
) -> Request:
    """A copy of ``request`` with the card's defaults filled in, or a typed error.

    ``samplers`` are the sampler names registered in the deployment (its instance's
    ``registry.sampler_names()``; None: those registered here, the kernel's built-ins
    outside a driven loop): a request may name one that no loop of the card binds, unless
    the recipe fixes the loop.

    ``allow_recipe_mismatch`` is the deployment's explicit override of the recipe's
    ``assumes_precision`` and of a distilled adapter's loop and step count
    (``InstanceOptions.allow_recipe_mismatch``); requests never set it.

    ``adapters`` is the deployment's registry (None: adapters disabled): the request's adapters
    and the card's default stack must name registered adapters (``UnknownAdapter`` naming
    ``adapters[i].name``), and their versions are pinned in the result. An adapter that declares
    ``assumes_loop`` / ``assumes_steps`` fills the request's sampler and steps when it gives none,
    and refuses others (``RecipeMismatch``) unless ``allow_recipe_mismatch``.

    Last, the filled request is checked against the recipe's trained envelope
    (:func:`check_envelope`; its warnings are for the caller to report).
    """
    resolved = _resolve(card, request, limits, allow_recipe_mismatch=allow_recipe_mismatch, samplers=samplers,
                        adapters=adapters)
    check_envelope(card, resolved)
    return resolved


def _resolve(
    card: ModelCard,
    request: Request,
    limits: RequestLimits | None = None,
    *,
    allow_recipe_mismatch: bool = False,
    samplers: Iterable[str] | None = None,
    adapters: AdapterRegistry | None = None,
) -> Request:
    limits = limits or RequestLimits()
    caps = card.capabilities
    if request.model != card.model_id:
        raise InvalidRequest("model", f"request names {request.model!r} but was validated against {card.model_id!r}")
    if request.task not in caps.tasks:
        raise InvalidRequest(
            "task", f"card {card.model_id!r} cannot run {request.task.value!r}", allowed=sorted(t.value for t in caps.tasks)
        )
    _check_text(card, request)
    _check_precision(card, request, allow_recipe_mismatch)
    _check_modalities(card, request)
    request, active = _resolve_adapters(card, request, adapters)
    if request.task is TaskType.TEXT_GENERATION:
        if limits.max_tokens is not None and request.ar is not None and request.ar.max_tokens > limits.max_tokens:
            raise InvalidRequest("max_tokens", f"{request.ar.max_tokens} exceeds this deployment's limit", allowed=f"<= {limits.max_tokens}")
        return request
    d = request.diffusion
    if d.guidance is not None and d.guidance > 1.0 and not caps.uses_guidance:
        raise InvalidRequest(
            "guidance",
            f"card {card.model_id!r} (recipe {card.recipe.method!r}) runs without classifier-free guidance",
            allowed="omit it, or a value <= 1",
        )
    if d.guidance_2 is not None and (caps.defaults is None or caps.defaults.guidance_2 is None):
        raise InvalidRequest("guidance_2", f"card {card.model_id!r} has a single expert; guidance_2 does not apply", allowed="omit it")
    if d.switch_step is not None and (caps.defaults is None or caps.defaults.guidance_2 is None):
        raise InvalidRequest("switch_step", f"card {card.model_id!r} has a single expert; switch_step does not apply",
                             allowed="omit it")
    request = _distilled_defaults(card, request, active)
    d = request.diffusion
    loop_id = select_denoise_loop(card, request)
    _check_sampler(card, request, samplers)
    defaults = caps.defaults
    if defaults is None:
        _check_shape(card, d)
        _check_distilled(card, request, loop_id, active, allow_recipe_mismatch)
        return request
    frames = 1 if request.task is TaskType.TEXT_TO_IMAGE and d.frames is None else (d.frames or defaults.frames)
    filled = DiffusionParams(
        height=d.height or defaults.height,
        width=d.width or defaults.width,
        frames=frames,
        fps=d.fps or defaults.fps,
        steps=d.steps or defaults.steps,
        guidance=d.guidance if d.guidance is not None else defaults.guidance,
        guidance_2=d.guidance_2 if d.guidance_2 is not None else defaults.guidance_2,
        switch_step=d.switch_step,
        shift=d.shift if d.shift is not None else defaults.shift,
        sampler=d.sampler,
        seed=d.seed,
    )
    m = caps.spatial_multiple
    for name in ("height", "width"):
        value = getattr(filled, name)
        if value % m:
            raise InvalidRequest(name, f"{value} is not divisible by {m} (the VAE x patch factor)", allowed=f"multiples of {m}")
    assert filled.frames is not None and filled.height is not None and filled.width is not None
    if not caps.frame_rule.accepts(filled.frames):
        raise InvalidRequest("frames", f"{filled.frames} frames is not valid for {card.model_id!r}", allowed=caps.frame_rule.describe())
    if caps.max_frames is not None and filled.frames > caps.max_frames:
        raise InvalidRequest("frames", f"{filled.frames} exceeds the card's maximum", allowed=f"<= {caps.max_frames}")
    if limits.max_frames is not None and filled.frames > limits.max_frames:
        raise InvalidRequest("frames", f"{filled.frames} exceeds this deployment's limit", allowed=f"<= {limits.max_frames}")
    pixels = filled.height * filled.width
    for cap, where in ((caps.max_pixels, "the card's"), (limits.max_pixels, "this deployment's")):
        if cap is not None and pixels > cap:
            raise InvalidRequest("size", f"{filled.width}x{filled.height} exceeds {where} maximum of {cap} pixels", allowed=f"width*height <= {cap}")
    _check_shape(card, filled)
    if filled.switch_step is not None and filled.steps is not None and filled.switch_step > filled.steps:
        raise InvalidRequest("switch_step", f"{filled.switch_step} is past the last of {filled.steps} steps",
                             allowed=f"0..{filled.steps}")
    if limits.max_steps is not None and filled.steps is not None and filled.steps > limits.max_steps:
        raise InvalidRequest("steps", f"{filled.steps} exceeds this deployment's limit", allowed=f"<= {limits.max_steps}")
    resolved = request.with_updates(diffusion=filled)
    _check_distilled(card, resolved, loop_id, active, allow_recipe_mismatch)
    return resolved


def resolve_for_instance(instance: ModelInstance, request: Request, limits: RequestLimits | None = None) -> Request:
    """:func:`resolve_request` against a resident instance: its recipe override, its registered
    samplers, and its one precision (a request may ask for it, not change it)."""
    resolved = resolve_request(
        instance.card, request, limits, allow_recipe_mismatch=instance.options.allow_recipe_mismatch,
        samplers=instance.registry.sampler_names(), adapters=instance.adapters,
    )
    if resolved.precision is not None and resolved.precision != instance.precision:
        raise InvalidRequest(
            "precision", f"this deployment serves {instance.model_id!r} in {instance.precision!r} only",
            allowed=[instance.precision],
        )
    _check_loops(instance, resolved)
    return resolved


def _check_loops(instance: ModelInstance, request: Request) -> None:
    """Each loop of the request's program that overrides ``Loop.check_request`` refuses what it can never run.

    Only those loops are built here (others keep building lazily, in the scheduler).
    """
    for loop_id in instance.request_checking_loops(request.task):
        instance.loop(loop_id).check_request(request, instance)


def _frames_at(card: ModelCard, seconds: float, rate: float) -> int:
    wanted = max(1, round(seconds * rate))
    rule = card.capabilities.frame_rule
    k = max(0, math.ceil((wanted - rule.remainder) / rule.modulus))
    frames = rule.remainder + rule.modulus * k
    if frames < 1:
        frames += rule.modulus
    return frames


def _seconds_misfit(card: ModelCard, frames: int, rate: float, *, envelope: bool = True) -> str | None:
    """Why a clip of ``frames`` at ``rate`` is not one the card makes (its maximum, its envelope), or None."""
    caps, declared = card.capabilities, card.recipe.envelope if envelope else None
    limit = min((m for m in (caps.max_frames, caps.token_grid.max_frames if caps.token_grid else None) if m is not None),
                default=None)
    if limit is not None and frames > limit:
        return f"the card makes at most {limit} frames"
    if declared is None:
        return None
    if not declared.accepts_fps(rate):
        return f"it was trained at {declared.describe_fps()} fps"
    if not declared.accepts_frames(frames):
        return f"it was trained on clips of {declared.describe_frames()} frames"
    return None


def frames_for_seconds(
    card: ModelCard, seconds: float, fps: float | None, *, allow_outside_envelope: bool = False
) -> tuple[int, float]:
    """The frame count and rate of a clip asked for in seconds (the OpenAI video API's ``seconds``):
    ``seconds * fps`` (the card's default fps when ``fps`` is None) rounded up to the nearest count
    the card's frame rule accepts (e.g. 4k+1). A typed error on ``fps`` when neither gives a rate.

    A clip longer than the card makes, or outside its trained envelope's frame counts or rates, is
    refused on ``seconds``, allowing the OpenAI durations (:data:`OPENAI_SECONDS`) that fit at that
    rate, unless ``allow_outside_envelope`` (then only the card's maximum refuses).
    """
    caps = card.capabilities
    rate = fps or (caps.defaults.fps if caps.defaults else None)
    if rate is None:
        raise InvalidRequest("fps", "required with seconds for this card")
    frames = _frames_at(card, seconds, rate)
    misfit = _seconds_misfit(card, frames, rate, envelope=not allow_outside_envelope)
    if misfit is not None:
        able = [str(s) for s in OPENAI_SECONDS if _seconds_misfit(card, _frames_at(card, s, rate), rate) is None]
        default = caps.defaults
        clip = f"{default.frames} frames at {default.fps:g} fps, {default.frames / default.fps:.2f} s" if default else None
        allowed = (", ".join(able) if able else "none of " + ", ".join(str(s) for s in OPENAI_SECONDS))
        allowed += f" (at {rate:g} fps); or omit seconds" + (f" for the card's clip ({clip})" if clip else "")
        envelope = card.recipe.envelope
        if envelope is not None and (envelope.frames is not None or envelope.max_frames is not None or envelope.fps):
            allowed += f", {OVERRIDE_HINT}"
        raise InvalidRequest(
            "seconds", f"{seconds:g} s at {rate:g} fps is {frames} frames, which card {card.model_id!r} does not make "
            f"({misfit})", allowed=allowed,
        )
    return frames, rate
