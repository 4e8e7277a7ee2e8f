"""Throughput-mode batching at mixed step indices on toy-dit: one fused step, rows at different timesteps.

``tests/test_mixed_step_batching.py`` runs staggered arrivals in exact mode, where each
request of a batch runs through the op alone, and the throughput tests run their requests
in lockstep, where every row of a batch is at the same timestep. Neither ever hands the
DiT op a batch whose rows are at different timesteps, so an op that used row 0's timestep
for every row passed them all. Here request B arrives once A has done ``OFFSET`` denoise
steps (``run_staggered``: submitted from A's progress event; ``device_thread=False`` runs
the model inline on the event loop, so the join point is fixed by event order, not timing),
under ``batching="throughput"``: their shared steps run as one ``run_fused`` call holding
A at a later step than B, and each video must equal its run alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import pytest
import torch

from fv_kernel.api import (
    DiffusionParams,
    Engine,
    GenerationResult,
    ModelCard,
    ModelInstance,
    Request,
    SchedulerConfig,
    StepOp,
    StepRecord,
    TaskType,
    TextPart,
    build_instance,
    run_concurrently,
)
from fv_kernel.testing import StepRecorder, assert_artifacts_identical, run_staggered
from fv_kernel.testing.toy import toy_card

STEPS = 8
OFFSET = 3
#: Max abs difference between a request's video fused with a staggered one and its run alone
#: (fp32 on CPU, frames in [0, 1]). A fused batch reduces its matmuls in another order than the
#: request's own rows alone, so throughput mode is not bit-identical. Measured 2026-12 on CPU:
#: 1.8e-7 (batched CFG dispatch), 0.0 (sequential); tolerance ~55x above that. The row-0-timestep
#: bug (see the negative control below) gives 5.1e-3, ~500x above it.
FUSED_ATOL = 1e-5


def _card(dispatch: str) -> ModelCard:
    """toy-dit with its denoise loop's CFG dispatch set: "batched" runs all rows of a step as one
    forward; "sequential" (the card's default) runs one forward per row inside the one op call."""
    card = toy_card("toy-dit")
    loops = {
        k: (v.model_copy(update={"config": {**v.config, "cfg_dispatch": dispatch}}) if k == "denoise" else v)
        for k, v in card.loops.items()
    }
    return card.model_copy(update={"loops": loops})


def _request(i: int) -> Request:
    return Request(
        request_id=f"tm{i}", model="toy-dit", task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text=f"prompt number {i}"),), diffusion=DiffusionParams(seed=i, steps=STEPS, guidance=4.0),
    )


def _engine(instance: ModelInstance, batching: str = "throughput", *observers: Any) -> Engine:
    # Explicit batching mode: the test is about throughput mode whatever the default becomes.
    engine = Engine(SchedulerConfig(batching=batching, device_thread=False), observers=list(observers))  # type: ignore[arg-type]
    engine.add_instance(instance)
    return engine


def _video_diff(a: GenerationResult, b: GenerationResult) -> float:
    assert a.status == b.status == "completed", (a.error, b.error)
    return (a.artifact("video").frames - b.artifact("video").frames).abs().max().item()  # type: ignore[union-attr]


def _mixed_step_fused(records: list[StepRecord]) -> list[StepRecord]:
    """Denoise batches of two or more requests whose rows were at different step indices."""
    return [r for r in records if r.kind == "diffusion_step" and r.batch_size >= 2 and len(set(r.steps)) > 1]


def _distinct_rows(t: torch.Tensor) -> int:
    return len({tuple(row.flatten().tolist()) for row in t})


@dataclasses.dataclass
class StaggeredRun:
    results: list[GenerationResult]
    alone: list[GenerationResult]
    mixed: list[StepRecord]
    #: Forwards of the DiT module itself whose rows were at different timesteps.
    mixed_forwards: int
    fused_fallbacks: dict[str, int]

    @property
    def diffs(self) -> list[float]:
        return [_video_diff(a, b) for a, b in zip(self.alone, self.results)]


def _run_staggered(instance: ModelInstance, batching: str = "throughput") -> StaggeredRun:
    requests = [_request(i) for i in range(2)]
    alone = [_engine(instance, batching).generate(r) for r in requests]
    recorder = StepRecorder()
    engine = _engine(instance, batching, recorder)
    forward_t: list[torch.Tensor] = []
    hook = instance.component("dit").register_forward_pre_hook(lambda _m, args: forward_t.append(args[1].clone()))
    try:
        results = run_staggered(engine, requests, loop_id="denoise", offset=OFFSET)
    finally:
        hook.remove()
    mixed_forwards = sum(_distinct_rows(t) > 1 for t in forward_t)
    return StaggeredRun(results, alone, _mixed_step_fused(recorder.records), mixed_forwards, dict(engine.metrics.fused_fallbacks))


@pytest.mark.parametrize("dispatch", ["batched", "sequential"])
def test_staggered_arrivals_fuse_rows_at_different_timesteps_and_match_runs_alone(dispatch: str) -> None:
    run = _run_staggered(build_instance(_card(dispatch)))
    print(f"toy-dit {dispatch}: {len(run.mixed)} fused mixed-step denoise batches, "
          f"{run.mixed_forwards} DiT forwards holding rows at different timesteps; diffs vs alone {run.diffs}")

    # (a) A mixed-timestep batch really ran, fused: one op call over both requests' rows
    # (throughput mode fuses every batch of 2+; a fused call that raised would show in fused_fallbacks).
    assert run.mixed, "no denoise batch held two requests at different step indices"
    assert run.fused_fallbacks == {}

    # (b) Each request's video equals its run alone, within throughput mode's reduction-order noise.
    for diff, result in zip(run.diffs, run.results):
        assert diff <= FUSED_ATOL, (
            f"{result.request_id}: staggered fused run drifted {diff:.3g} from its run alone (allowed {FUSED_ATOL})"
        )

    # The DiT module itself: under "batched" dispatch each shared step was one forward holding both
    # requests' rows at their own timesteps; under "sequential" (the card's default) the op runs
    # every row as its own forward, inside the one fused op call.
    assert run.mixed_forwards == (len(run.mixed) if dispatch == "batched" else 0)


# --------------------------------------------------------------------------- negative control


def _row0_timestep_instance(card: ModelCard) -> ModelInstance:
    """The toy card's instance with BUG: its DiT op uses row 0's timestep for every row of a batch."""
    instance = build_instance(card)
    inner = instance.ops_builder

    def ops(inst: ModelInstance) -> dict[str, StepOp]:
        built = dict(inner(inst))
        plain = built["dit_forward"].fn

        def dit_forward(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            return plain({**inputs, "t": inputs["t"][:1].expand_as(inputs["t"])}, params)

        built["dit_forward"] = dataclasses.replace(built["dit_forward"], fn=dit_forward)
        return built

    instance.ops_builder = ops
    return instance


def test_row0_timestep_bug_fails_the_staggered_throughput_check_and_nothing_else() -> None:
    """The bug this file guards against: invisible in exact mode and in lockstep batches, caught here."""
    card = _card("batched")

    # Staggered, throughput: the same mixed-step fused batches ran, and the joining request's video is far off.
    run = _run_staggered(_row0_timestep_instance(card))
    assert run.mixed and run.fused_fallbacks == {}
    assert run.mixed_forwards == 0  # every forward saw one timestep
    assert run.diffs[0] <= FUSED_ATOL  # the first request's rows are row 0: its timestep is right
    assert run.diffs[1] > 100 * FUSED_ATOL, f"the row-0 timestep bug drifted only {run.diffs[1]:.3g}"
    print(f"toy-dit with the row-0 timestep bug: diffs vs alone {run.diffs}")

    # Staggered, exact mode: each request runs through the op alone, so all its rows share a timestep.
    exact = _run_staggered(_row0_timestep_instance(card), batching="exact")
    assert exact.mixed
    for single, together in zip(exact.alone, exact.results):
        assert_artifacts_identical(single.artifacts, together.artifacts, what="exact mode with the bug")

    # Lockstep, throughput: every row of every batch is at the same step.
    buggy = _row0_timestep_instance(card)
    requests = [_request(i) for i in range(2)]
    alone = [_engine(buggy).generate(r) for r in requests]
    recorder = StepRecorder()
    together = run_concurrently(_engine(buggy, "throughput", recorder), requests)
    assert any(r.batch_size == 2 for r in recorder.of_kind("diffusion_step"))
    assert _mixed_step_fused(recorder.records) == []
    assert max(_video_diff(a, b) for a, b in zip(alone, together)) <= FUSED_ATOL
