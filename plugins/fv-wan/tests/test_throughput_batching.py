"""Throughput-mode (fused) batching on wan-tiny: concurrent requests' denoise steps run as one forward.

``SchedulerConfig(batching="throughput")`` fuses compatible steps of different requests
into one ``op.run_fused`` call. With ``cfg_dispatch: batched`` the DiT then runs all rows
(2 CFG branches x N requests) as one batch, which is what the test checks on the model
itself (a forward pre-hook counts the rows of every forward). Under the card's default
``cfg_dispatch: sequential`` each guidance branch keeps its own forward, as diffusers'
two-forward CFG runs them, and the fused requests share it: two forwards of N rows per step.

A fused batch is not bit-identical to per-request forwards: the matmuls of a batch of 8
rows reduce in another order than a batch of 2. The fused videos must stay within
``FUSED_ATOL`` of the exact-mode ones; exact mode (the default) stays bit-identical to
serial runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from fv_kernel.api import (
    DiffusionParams,
    Engine,
    GenerationResult,
    ModelInstance,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    build_instance,
    run_concurrently,
)
from fv_kernel.testing import StepRecorder, assert_artifacts_identical

N_REQUESTS = 4
STEPS = 3
#: Max abs difference allowed between fused and exact decoded frames (fp32, values in [0, 1]).
#: The same bound as wan-tiny's fp32 parity against diffusers (docs/models/wan.md): both
#: differences come only from kernel reduction order. Measured: 1.7e-6 (2026-11-30, CPU).
FUSED_ATOL = 1e-5


@pytest.fixture(scope="module")
def instance(wan_card: Any) -> ModelInstance:
    return build_instance(wan_card("wan-tiny", cfg_dispatch="batched"))


def _requests(guidance: float = 5.0) -> list[Request]:
    return [
        Request(
            request_id=f"tp{i}", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO,
            inputs=(TextPart(text=f"a fox in the snow, take {i}"), TextPart(text="blurry", role="negative_prompt")),
            diffusion=DiffusionParams(seed=i, steps=STEPS, height=32, width=32, frames=5, guidance=guidance),
        )
        for i in range(N_REQUESTS)
    ]


def _run(instance: ModelInstance, batching: str, requests: list[Request]) -> tuple[list[GenerationResult], list[int], list[int]]:
    """Run all requests at once; return the results, the denoise batch sizes and the rows of every DiT forward."""
    recorder = StepRecorder()
    engine = Engine(SchedulerConfig(batching=batching), observers=[recorder])  # type: ignore[arg-type]
    engine.add_instance(instance)
    forward_rows: list[int] = []
    handle = instance.component("transformer").register_forward_pre_hook(lambda _m, args: forward_rows.append(int(args[0].shape[0])))
    try:
        results = run_concurrently(engine, requests)
    finally:
        handle.remove()
    for r in results:
        r.raise_for_status()
    return results, [rec.batch_size for rec in recorder.of_kind("diffusion_step")], forward_rows


def _max_diff(left: list[GenerationResult], right: list[GenerationResult]) -> float:
    return max(
        (a.artifact("video").frames - b.artifact("video").frames).abs().max().item()  # type: ignore[union-attr]
        for a, b in zip(left, right)
    )


def test_throughput_mode_runs_concurrent_denoise_steps_as_one_forward_close_to_exact(instance: ModelInstance) -> None:
    requests = _requests()
    exact, exact_batches, exact_forwards = _run(instance, "exact", requests)
    fused, fused_batches, fused_forwards = _run(instance, "throughput", requests)

    # Both modes schedule the four requests' steps together...
    assert exact_batches == fused_batches == [N_REQUESTS] * STEPS
    # ...exact mode then runs each request's two CFG rows alone; throughput mode runs all rows in one forward
    # (a failed fused call would fall back to per-request forwards and show up here).
    assert exact_forwards == [2] * (N_REQUESTS * STEPS)
    assert fused_forwards == [2 * N_REQUESTS] * STEPS

    diff = _max_diff(exact, fused)
    assert diff <= FUSED_ATOL, f"fused batch drifted {diff:.3g} from exact mode (allowed {FUSED_ATOL})"
    # The comparison has teeth: the fused results really are different numbers (not the exact path again)...
    assert diff > 0
    # ...and a 1% guidance change (a real change to the request) is far outside the tolerance.
    nudged, _, _ = _run(instance, "throughput", _requests(guidance=5.05))
    assert _max_diff(fused, nudged) > 10 * FUSED_ATOL


def test_exact_mode_stays_bit_identical_to_serial_runs(instance: ModelInstance) -> None:
    requests = _requests()
    together, batches, _ = _run(instance, "exact", requests)
    assert batches == [N_REQUESTS] * STEPS  # really scheduled together
    for request, result in zip(requests, together):
        engine = Engine(SchedulerConfig())
        engine.add_instance(instance)
        alone = engine.generate(request.model_copy(update={"request_id": f"{request.request_id}-alone"}))
        assert_artifacts_identical(alone.artifacts, result.artifacts, what=f"{request.request_id}: exact batch vs alone")


def test_sequential_dispatch_shares_each_branch_forward_across_fused_requests(wan_card: Any) -> None:
    sequential = build_instance(wan_card("wan-tiny", cfg_dispatch="sequential"))
    requests = _requests()
    exact, _, exact_forwards = _run(sequential, "exact", requests)
    fused, fused_batches, fused_forwards = _run(sequential, "throughput", requests)
    assert fused_batches == [N_REQUESTS] * STEPS
    # Exact mode: each request's branches one by one. Throughput: one forward per branch over the N requests
    # (before, the op ran every row alone here too: 2N forwards of one row per step).
    assert exact_forwards == [1] * (2 * N_REQUESTS * STEPS)
    assert fused_forwards == [N_REQUESTS] * (2 * STEPS)
    diff = _max_diff(exact, fused)
    # Rows go back to their own request and branch (a mix-up is far outside the tolerance).
    assert 0 < diff <= FUSED_ATOL, f"fused sequential batch drifted {diff:.3g} from exact mode (allowed {FUSED_ATOL})"
