"""Cross-request batching at mixed step indices (design §6.3).

A request that arrives while another is mid-trajectory batches with it from its first
denoise step: the step index and the timestep are per-sample values, so the batch key
names only what must really match (op, shapes, dtype, branch layout).
"""

from __future__ import annotations

import asyncio

import pytest

from fv_kernel.api import DiffusionParams, Engine, Request, SchedulerConfig, TaskType, TextPart, WorkPlan, build_instance
from fv_kernel.testing import StepRecorder, assert_artifacts_identical, run_staggered, unbatched_co_resident
from fv_kernel.testing.toy import ToyDenoiseLoop, toy_card

STEPS = 8


def request(i: int) -> Request:
    return Request(
        request_id=f"r{i}", model="toy-dit", task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text=f"prompt number {i}"),), diffusion=DiffusionParams(seed=i, steps=STEPS),
    )


def engine(recorder: StepRecorder) -> Engine:
    e = Engine(SchedulerConfig(batching="exact"), observers=[recorder])  # bit-identity: throughput is test_throughput_mixed_step.py
    e.add_instance(build_instance(toy_card("toy-dit")))
    return e


def test_staggered_requests_batch_like_lockstep_ones() -> None:
    requests = [request(i) for i in range(3)]
    alone = [engine(StepRecorder()).generate(r) for r in requests]
    totals = {r.request_id: STEPS for r in requests}

    lockstep = StepRecorder()
    e = engine(lockstep)

    async def all_at_once() -> None:
        async with e.running():
            await asyncio.gather(*(e.generate_async(r) for r in requests))

    asyncio.run(all_at_once())
    assert unbatched_co_resident(lockstep.of_kind("diffusion_step"), totals) == []

    staggered = StepRecorder()
    results = run_staggered(engine(staggered), requests, loop_id="denoise", offset=3)
    batches = staggered.of_kind("diffusion_step")
    assert unbatched_co_resident(batches, totals) == [], "a denoise step ran alone while another request was mid-trajectory"
    assert any(len(set(r.steps)) > 1 for r in batches), "no batch held requests at different step indices"
    for single, together in zip(alone, results):
        assert together.status == "completed", together.error
        assert_artifacts_identical(single.artifacts, together.artifacts, what=f"{together.request_id} staggered vs alone")


def test_a_per_request_scalar_in_params_breaks_mixed_step_batching(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the bug this file guards against (the step index in the batch key)."""
    original = ToyDenoiseLoop.next

    def next_with_step_in_params(self: ToyDenoiseLoop, state):  # type: ignore[no-untyped-def]
        plan = original(self, state)
        if isinstance(plan, WorkPlan):
            plan = plan.model_copy(update={"params": {**plan.params, "step_index": state.step}})
        return plan

    monkeypatch.setattr(ToyDenoiseLoop, "next", next_with_step_in_params)
    recorder = StepRecorder()
    requests = [request(i) for i in range(2)]
    run_staggered(engine(recorder), requests, loop_id="denoise", offset=3)
    totals = {r.request_id: STEPS for r in requests}
    assert unbatched_co_resident(recorder.of_kind("diffusion_step"), totals), "staggered requests batched despite the bug"


def test_a_loop_spec_that_is_not_batchable_keeps_every_step_alone() -> None:
    card = toy_card("toy-dit")
    loops = {k: (v.model_copy(update={"batchable": False}) if k == "denoise" else v) for k, v in card.loops.items()}
    solo_card = card.model_copy(update={"loops": loops})
    recorder = StepRecorder()
    e = Engine(SchedulerConfig(batching="exact"), observers=[recorder])  # bit-identity: throughput is test_throughput_mixed_step.py
    e.add_instance(build_instance(solo_card))

    async def all_at_once() -> None:
        async with e.running():
            await asyncio.gather(*(e.generate_async(request(i)) for i in range(2)))

    asyncio.run(all_at_once())
    denoise = recorder.of_kind("diffusion_step")
    assert denoise and all(r.batch_size == 1 for r in denoise)
    assert any(r.batch_size > 1 for r in recorder.records), "the other loops still batch"
