"""StepSkip: a step interceptor that answers marked steps with the last computed prediction.

A static schedule, like cache-dit's ``steps_computation_mask`` with the ``static``
policy but at step granularity: a step marked 0 does not run the transformer at all;
the loop gets the outputs of the last step that did (for a flow model, the last
velocity). Few-step distilled cards (DMD) refuse this class of interceptor: each of
their 3 steps jumps far along the trajectory, so a reused prediction is simply wrong.

State: ``LoopState.plugin_state["step-skip"]`` (one per request and loop; a step's
outputs hold every guidance branch, so no per-branch split is needed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fv_kernel.api import StepInterceptor, StepResult

from fv_cachedit.overrides import apply_overrides, overrides_model

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.api import WorkPlan

__all__ = ["StepSkipSettings", "StepSkipParams", "StepSkip"]


class StepSkipSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The first steps always run (the trajectory's layout is decided there).
    warmup_steps: int = Field(default=4, ge=0)
    #: After warmup, run every ``compute_every``-th step and reuse in between (1: never reuse).
    compute_every: int = Field(default=1, ge=1)
    #: Explicit schedule, one entry per step: 1 runs, 0 reuses; steps past its end run. Overrides the two above.
    steps_computation_mask: Optional[tuple[Literal[0, 1], ...]] = None

    @field_validator("steps_computation_mask")
    @classmethod
    def _mask_starts_with_a_computed_step(cls, mask: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if mask and mask[0] != 1:
            raise ValueError("must start with 1: step 0 has no earlier prediction to reuse")
        return mask

    def computes(self, step: int) -> bool:
        if self.steps_computation_mask is not None:
            mask = self.steps_computation_mask
            return step >= len(mask) or mask[step] == 1
        return step < self.warmup_steps or (step - self.warmup_steps) % self.compute_every == 0

    @property
    def skips_any(self) -> bool:
        if self.steps_computation_mask is not None:
            return 0 in self.steps_computation_mask
        return self.compute_every > 1


StepSkipParams = overrides_model(StepSkipSettings, "StepSkipParams")


class StepSkip(StepInterceptor):
    """Reuse the last computed step's outputs on the steps its schedule marks."""

    plugin_id: ClassVar[str] = "step-skip"
    config_model: ClassVar[type[BaseModel]] = StepSkipSettings
    request_model: ClassVar[type[BaseModel]] = StepSkipParams

    def settings(self, params: BaseModel | None) -> StepSkipSettings:
        return apply_overrides(self.config, params)  # type: ignore[no-any-return]

    def parse_params(self, raw: dict[str, Any] | None) -> BaseModel:
        params = self.request_model.model_validate(raw or {})
        self.settings(params)
        return params

    def distribution_altering(self, params: BaseModel) -> bool:
        return self.settings(params).skips_any

    async def around_step(
        self,
        plan: "WorkPlan",
        state: dict[str, Any],
        params: BaseModel,
        call_next: Callable[["WorkPlan"], Awaitable[StepResult]],
    ) -> StepResult:
        # Loops that do not publish a step index are counted here (one call per step).
        step = plan.step_index if plan.step_index is not None else len(state.get("computed_steps", [])) + len(state.get("skipped_steps", []))
        settings = self.settings(params)
        if not state:
            state.update(computed_steps=[], skipped_steps=[])
        if "outputs" in state and not settings.computes(step):
            state["skipped_steps"].append(step)
            return StepResult(outputs=dict(state["outputs"]))
        result = await call_next(plan)
        state["computed_steps"].append(step)
        state["outputs"] = dict(result.outputs)
        return result
