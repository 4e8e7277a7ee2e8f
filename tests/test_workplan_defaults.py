"""A plan is made on every step of every request: its defaults must not be deep-copied models.

Pydantic deep-copies a model given as a field default each time the model is built (12 µs per
default on the CPU the benchmarks ran on); ``WorkPlan`` and ``StepEstimate`` build theirs from
factories instead (1.5 µs). Measured effect: ``bench/bench_scheduler.py --overhead-only``.
"""

from __future__ import annotations

import pydantic
import pytest

from fv_kernel.loop.plan import StepEstimate, WorkKind, WorkPlan


def test_default_plans_and_estimates_deep_copy_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: pydantic.BaseModel, memo: dict | None = None) -> pydantic.BaseModel:
        raise AssertionError(f"deep-copied a {type(self).__name__} default")

    monkeypatch.setattr(pydantic.BaseModel, "__deepcopy__", refuse)
    first = WorkPlan(loop_id="denoise", instance_id="i", kind=WorkKind.DIFFUSION_STEP, op="dit_forward")
    second = WorkPlan(loop_id="denoise", instance_id="i", kind=WorkKind.DIFFUSION_STEP, op="dit_forward")
    StepEstimate(loop_id="denoise", kind=WorkKind.DIFFUSION_STEP)
    # Each plan still owns its defaults: pool_blocks is a dict a caller may fill.
    assert first.resources is not second.resources and first.resources.pool_blocks is not second.resources.pool_blocks
