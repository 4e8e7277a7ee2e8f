"""The recipe's teeth that need only the card and the request (design §4.2).

Which denoise loop a request runs on a card (``RecipeSpec.assumes_loop`` refuses another
sampler or step count with ``RecipeMismatch``), and whether an attention backend departs
from ``RecipeSpec.assumes_attention``. Programs choose loops with these before any
instance exists; :mod:`fv_kernel.model.validate` builds the full request validation on them.
"""

from __future__ import annotations

from fv_kernel.card.spec import LoopSpec, ModelCard
from fv_kernel.errors import RecipeMismatch
from fv_kernel.request.request import Request

__all__ = ["sampler_short_name", "describe_loop", "select_denoise_loop", "check_recipe_attention"]


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
