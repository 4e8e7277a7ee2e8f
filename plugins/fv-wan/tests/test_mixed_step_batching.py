"""wan-tiny: requests arriving mid-trajectory batch their denoise steps with the running ones
(``batching: exact``, bit-identical; throughput batching is ``test_throughput_mixed_step.py``).

The DiT op takes one timestep per row, and the plan's params hold no per-request
scalar, so a request joining at another's step 3 shares every step from then on, and
each request's video equals its run alone.
"""

from __future__ import annotations

from typing import Any

from fv_kernel.api import DiffusionParams, Engine, Request, SchedulerConfig, TaskType, TextPart, build_instance
from fv_kernel.testing import StepRecorder, assert_artifacts_identical, run_staggered, unbatched_co_resident

STEPS = 6


def test_wan_tiny_staggered_arrivals_batch_at_mixed_steps(wan_card: Any) -> None:
    card = wan_card("wan-tiny")
    instance = build_instance(card)
    requests = [
        Request(request_id=f"w{i}", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=f"a fox, take {i}"),),
                diffusion=DiffusionParams(seed=i, steps=STEPS, height=32, width=32, frames=5))
        for i in range(3)
    ]
    alone = []
    for r in requests:
        e = Engine(SchedulerConfig(batching="exact"))
        e.add_instance(instance)
        alone.append(e.generate(r))
    recorder = StepRecorder()
    e = Engine(SchedulerConfig(batching="exact"), observers=[recorder])
    e.add_instance(instance)
    results = run_staggered(e, requests, loop_id="denoise", offset=2)
    batches = recorder.of_kind("diffusion_step")
    assert unbatched_co_resident(batches, {r.request_id: STEPS for r in requests}) == []
    assert any(len(set(r.steps)) > 1 for r in batches), "no batch held requests at different step indices"
    for single, together in zip(alone, results):
        assert together.status == "completed", together.error
        assert_artifacts_identical(single.artifacts, together.artifacts, what=f"{together.request_id} staggered vs alone")
