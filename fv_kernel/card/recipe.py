"""The recipe's teeth that need only the card and the request (design §4.2).

Which denoise loop a request runs on a card (``RecipeSpec.assumes_loop`` refuses another
sampler or step count with ``RecipeMismatch``), and whether an attention backend departs
from ``RecipeSpec.assumes_attention``. Programs choose loops with these before any
instance exists; :mod:`fv_kernel.model.validate` builds the full request validation on them.

And whether a request stays inside what the weights were trained on (``RecipeSpec.envelope``):
:func:`check_envelope` refuses a departure unless the request overrides it, and returns the
warnings to report (unknown words, overridden departures).
"""

from __future__ import annotations

from fv_kernel.card.spec import LoopSpec, ModelCard
from fv_kernel.errors import InvalidRequest, RecipeMismatch
from fv_kernel.request.request import Request
from fv_kernel.request.types import TaskType

__all__ = [
    "sampler_short_name", "describe_loop", "select_denoise_loop", "check_recipe_attention", "check_envelope",
    "EnvelopeWarning", "OVERRIDE_HINT",
]

#: How each surface spells the envelope override (named in every refusal).
OVERRIDE_HINT = "or override: allow_outside_envelope (fv generate --allow-outside-envelope)"


class EnvelopeWarning(UserWarning):
    """A request runs outside its card's trained envelope, or its prompt has words the card never saw."""


def sampler_short_name(name: str) -> str:
    """A sampler's short name: ``"fv-hello/euler-shift3"`` and ``"euler-shift3"`` name one sampler."""
    return name.rsplit("/", 1)[-1]


def describe_loop(spec: LoopSpec) -> str:
    if spec.sampler is None:
        return f"loop {spec.loop_id!r}"
    steps = f"{spec.sampler.fixed_steps} steps" if spec.sampler.fixed_steps else "any step count"
    return f"loop {spec.loop_id!r} (sampler {spec.sampler.name!r}, {steps})"


def select_denoise_loop(card: ModelCard, request: Request) -> str | None:
    """The denoise loop a request runs on this card; raises RecipeMismatch when the recipe forbids it.

    A sampler bound to one of the card's denoise loops selects that loop. Any other
    sampler name selects the default loop, which then runs that sampler instead of its
    own (``bound_sampler``); whether the name is registered in the deployment is checked
    by :func:`resolve_request`.
    """
    program = card.programs.get(request.task)
    program_loops = [l for l in (program.loops if program else ()) if card.loops[l].kind == "diffusion_denoise"]
    candidates = card.denoise_loops()
    if not candidates:
        return None
    asked_sampler = request.diffusion.sampler
    asked_steps = request.diffusion.steps
    assumed_id = card.recipe.assumes_loop
    if assumed_id is not None and card.loops[assumed_id].kind == "diffusion_denoise":
        assumed = card.loops[assumed_id]
        binding = assumed.sampler
        wrong_sampler = asked_sampler is not None and binding is not None and sampler_short_name(asked_sampler) != sampler_short_name(binding.name)
        wrong_steps = (
            asked_steps is not None and binding is not None and binding.fixed_steps is not None
            and asked_steps != binding.fixed_steps
        )
        if wrong_sampler or wrong_steps:
            asked = f"sampler {asked_sampler or (binding.name if binding else '?')!r}"
            if asked_steps is not None:
                asked += f" with {asked_steps} steps"
            raise RecipeMismatch(
                "sampler" if wrong_sampler else "steps",
                model_id=card.model_id, method=card.recipe.method, assumes=describe_loop(assumed), asked=asked,
            )
        return assumed_id
    if asked_sampler is not None:
        for loop_id, spec in candidates.items():
            if spec.sampler is not None and sampler_short_name(spec.sampler.name) == sampler_short_name(asked_sampler):
                return loop_id
    return program_loops[0] if program_loops else next(iter(candidates))


def check_recipe_attention(card: ModelCard, attention_backend: str, allow_recipe_mismatch: bool) -> bool:
    """Whether ``attention_backend`` departs from the recipe's ``assumes_attention``.

    A departure is a ``RecipeMismatch`` naming ``attention_backend`` unless the deployment
    overrides the recipe; then it is allowed and reported (True) so the instance records it.
    """
    assumed = card.recipe.assumes_attention
    if assumed is None or attention_backend == assumed.kind:
        return False
    if not allow_recipe_mismatch:
        raise RecipeMismatch(
            "attention_backend", model_id=card.model_id, method=card.recipe.method, assumes=assumed.describe(),
            asked=(
                f"attention backend {attention_backend!r} (deploy it with attention_backend: {assumed.kind}; an explicit "
                "override runs it anyway: deploy config 'override_recipe: true', fv generate --override-recipe)"
            ),
        )
    return True


def _size(width: int, height: int) -> str:
    return f"{width}x{height}"


def check_envelope(card: ModelCard, request: Request) -> list[str]:
    """Check ``request`` (its defaults filled) against the card's ``RecipeSpec.envelope``.

    A departure (frames, size, fps, a prompt without one known word) raises ``InvalidRequest``
    naming the field and what the card was trained on, unless ``request.allow_outside_envelope``;
    then it is returned as a warning. Words outside a vocabulary are always returned (each reaches
    the model as ``<unk>``). An undeclared envelope field checks nothing. The prompt is checked as
    given: with ``prompt_upsampling`` the reasoner's rewrite is what the encoder reads, so its
    words are not checked.
    """
    envelope = card.recipe.envelope
    if envelope is None:
        return []
    warnings: list[str] = []
    where = f"card {card.model_id!r} (recipe {card.recipe.method!r}) was trained on"

    def depart(param: str, message: str, allowed: str) -> None:
        if not request.allow_outside_envelope:
            raise InvalidRequest(param, f"{message}; the card would make a wrong video without failing",
                                 allowed=f"{allowed} ({OVERRIDE_HINT})")
        warnings.append(f"{param}: {message} (allowed: {allowed}); running it anyway because of allow_outside_envelope")

    vocabulary = envelope.vocabulary
    if vocabulary is not None and not request.prompt_upsampling:
        for role in ("prompt", "negative_prompt"):
            text = request.text(role)
            if not text or not text.strip():
                continue
            unknown = vocabulary.unknown_words(text)
            if not unknown:
                continue
            quoted = ", ".join(repr(w) for w in unknown)
            if not vocabulary.content_words(text):
                filler = f" beyond {', '.join(repr(w) for w in vocabulary.function_words)}" if vocabulary.function_words else ""
                depart(role, f"no word of it{filler} is in the vocabulary {where} (these reach the model as <unk>: {quoted})",
                       "prompts made of its words: " + " ".join(vocabulary.words))
            else:
                warnings.append(f"{role}: {len(unknown)} word(s) outside the vocabulary {where} reach the model as <unk>: {quoted}")
    if request.task is TaskType.TEXT_GENERATION:
        return warnings
    d = request.diffusion
    if d.frames is not None and not envelope.accepts_frames(d.frames):
        depart("frames", f"{d.frames} frames is outside the frame counts {where}", envelope.describe_frames())
    if envelope.sizes is not None and d.width is not None and d.height is not None and (d.width, d.height) not in envelope.sizes:
        depart("size", f"{_size(d.width, d.height)} (width x height) is outside the sizes {where}",
               ", ".join(_size(w, h) for w, h in envelope.sizes))
    if d.fps is not None and not envelope.accepts_fps(d.fps):
        depart("fps", f"{d.fps:g} fps is outside the frame rates {where}", envelope.describe_fps())
    return warnings
