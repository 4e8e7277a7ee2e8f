"""wan-tiny, throughput mode, staggered arrivals: fused forwards hold rows at different timesteps.

``test_mixed_step_batching.py`` staggers arrivals in exact mode, where each request of a
batch runs through the DiT op alone, and ``test_throughput_batching.py`` fuses requests
that run in lockstep, where every row of a forward is at the same timestep. Neither hands
the DiT a forward whose rows are at different timesteps, so a ``dit_inputs`` that used row
0's timestep for every row passed both. Here request B arrives once A has done ``OFFSET``
denoise steps (``run_staggered``: submitted from A's progress event; ``device_thread=False``
runs the model inline on the event loop, so the join point is fixed by event order, not
timing), under ``batching="throughput"``: their shared steps run fused, each DiT forward
holding A's and B's rows at their own timesteps, and each video must equal its run alone.
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
from fv_kernel.testing import StepRecorder, run_staggered

STEPS = 6
OFFSET = 2
#: Max abs difference between a request's video fused with a staggered one and its run alone
#: (fp32 on CPU, frames in [0, 1]); the same bound as test_throughput_batching's FUSED_ATOL. A fused
#: forward reduces its matmuls in another order than the request's rows alone, so throughput mode is
#: not bit-identical. Measured 2026-12 on CPU: 6.6e-7 (sequential CFG dispatch), 7.7e-7 (batched);
#: tolerance ~13x above that. The row-0-timestep bug (negative control below) gives 1.0e-2, ~1000x above it.
FUSED_ATOL = 1e-5


def _request(i: int) -> Request:
    return Request(
        request_id=f"wm{i}", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=f"a fox, take {i}"),),
        diffusion=DiffusionParams(seed=i, steps=STEPS, height=32, width=32, frames=5),
    )


def _engine(instance: ModelInstance, *observers: Any) -> Engine:
    # Explicit batching mode: the test is about throughput mode whatever the default becomes.
    engine = Engine(SchedulerConfig(batching="throughput", device_thread=False), observers=list(observers))
    engine.add_instance(instance)
    return engine


def _video_diff(a: GenerationResult, b: GenerationResult) -> float:
    a.raise_for_status(), b.raise_for_status()
    return (a.artifact("video").frames - b.artifact("video").frames).abs().max().item()  # type: ignore[union-attr]


def _distinct_rows(t: torch.Tensor) -> int:
    return len({tuple(row.flatten().tolist()) for row in t})


@dataclasses.dataclass
class StaggeredRun:
    diffs: list[float]
    #: Denoise batches of two requests at different step indices (the Engine's step records).
    mixed: list[StepRecord]
    #: Forwards of the transformer itself whose rows were at different timesteps.
    mixed_forwards: int
    fused_fallbacks: dict[str, int]


def _run_staggered(instance: ModelInstance) -> StaggeredRun:
    requests = [_request(i) for i in range(2)]
    alone = [_engine(instance).generate(r) for r in requests]
    recorder = StepRecorder()
    engine = _engine(instance, recorder)
    forward_t: list[torch.Tensor] = []
    hook = instance.component("transformer").register_forward_pre_hook(lambda _m, args: forward_t.append(args[1].clone()))
    try:
        results = run_staggered(engine, requests, loop_id="denoise", offset=OFFSET)
    finally:
        hook.remove()
    mixed = [r for r in recorder.of_kind("diffusion_step") if r.batch_size >= 2 and len(set(r.steps)) > 1]
    return StaggeredRun(
        diffs=[_video_diff(a, b) for a, b in zip(alone, results)], mixed=mixed,
        mixed_forwards=sum(_distinct_rows(t) > 1 for t in forward_t), fused_fallbacks=dict(engine.metrics.fused_fallbacks),
    )


@pytest.mark.parametrize("dispatch", ["sequential", "batched"])
def test_wan_tiny_staggered_arrivals_fuse_forwards_at_mixed_timesteps(wan_card: Any, dispatch: str) -> None:
    run = _run_staggered(build_instance(wan_card("wan-tiny", cfg_dispatch=dispatch)))
    print(f"wan-tiny {dispatch}: {len(run.mixed)} fused mixed-step denoise batches, "
          f"{run.mixed_forwards} transformer forwards holding rows at different timesteps; diffs vs alone {run.diffs}")

    # The steps the two requests shared ran fused at mixed step indices: one op call each (a fused
    # call that raised would have been re-run per request and counted in fused_fallbacks).
    assert len(run.mixed) > 0, "no denoise batch held two requests at different step indices"
    assert run.fused_fallbacks == {}

    # Each request's video equals its run alone, within throughput mode's reduction-order noise.
    assert max(run.diffs) <= FUSED_ATOL, f"staggered fused run drifted {run.diffs} from runs alone (allowed {FUSED_ATOL})"

    # The transformer itself ran each shared step as one forward per CFG branch ("sequential", the
    # card's default) or one in all ("batched"), its rows at A's and B's own timesteps.
    assert run.mixed_forwards > 0, "no transformer forward held rows at different timesteps"
    assert run.mixed_forwards == len(run.mixed) * (2 if dispatch == "sequential" else 1)


def test_row0_timestep_bug_fails_the_check(wan_card: Any) -> None:
    """Negative control: a DiT op that uses row 0's timestep for every row (e.g. in ``dit_inputs``)."""
    instance = build_instance(wan_card("wan-tiny"))
    inner = instance.ops_builder

    def ops(inst: ModelInstance) -> dict[str, StepOp]:
        built = dict(inner(inst))
        for name, op in list(built.items()):
            if name.startswith("dit_forward"):
                def row0(
                    inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any], plain: Any = op.fn
                ) -> dict[str, torch.Tensor]:
                    return plain({**inputs, "t": inputs["t"][:1].expand_as(inputs["t"])}, params)

                built[name] = dataclasses.replace(op, fn=row0)
        return built

    instance.ops_builder = ops
    run = _run_staggered(instance)
    assert run.mixed and run.fused_fallbacks == {}  # the same fused mixed-step batches ran...
    assert run.mixed_forwards == 0  # ...but every forward saw one timestep
    assert run.diffs[0] <= FUSED_ATOL  # the first request's rows are row 0: its timestep is right
    assert run.diffs[1] > 100 * FUSED_ATOL, f"the row-0 timestep bug drifted only {run.diffs[1]:.3g}"
    print(f"wan-tiny with the row-0 timestep bug: diffs vs alone {run.diffs}")


def test_a_capturing_request_never_shares_a_fused_call(wan_card: Any) -> None:
    """Behaviour capture (RL rollouts) records what the request's own forward did: under throughput
    batching its rows run alone, bit-identical to its run alone, while the others fuse."""
    instance = build_instance(wan_card("wan-tiny"))
    requests = [_request(i) for i in range(3)]
    requests[1] = requests[1].with_updates(output=requests[1].output.model_copy(update={"capture_behavior": "final"}))
    recorder = StepRecorder()
    results = run_concurrently(_engine(instance, recorder), requests)
    rows = [(rid, fused) for rec in recorder.of_kind("diffusion_step") for rid, fused in zip(rec.request_ids, rec.fused)]
    assert any(fused for rid, fused in rows if rid != "wm1"), "the two plain requests fuse"
    assert not any(fused for rid, fused in rows if rid == "wm1"), "the capturing request ran inside a fused call"
    assert _video_diff(_engine(instance).generate(requests[1]), results[1]) == 0.0
