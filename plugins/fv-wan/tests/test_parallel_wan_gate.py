"""The interleave gate under sp=2 (2 gloo processes, one launch).

The kit's gate requests on wan-tiny (varied prompts, negative prompts, seeds, steps,
guidance, two sizes, text-to-video and text-to-image) run concurrently through one sp=2
pool, batched across requests, and each is bit-identical to the same request run alone
through a fresh sp=2 pool (fresh instances on both ranks). Under a plan the reference is a
plan run too: sequence parallel changes rounding against one device (within 1e-5, see
``test_parallel_wan.py``), but must not let requests leak into each other.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_kernel.parallel.launch import spawn


def run_gate(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    from fv_kernel.api import run_concurrently, run_serially
    from fv_kernel.config import CardDeployment, DeployConfig
    from fv_kernel.parallel import ParallelPlan
    from fv_kernel.deploy.parallel import deploy_parallel
    from fv_kernel.testing import InterleaveConformance, StepRecorder, assert_artifacts_identical

    class Gate(InterleaveConformance):
        card_ids = ["wan-tiny"]
        steps = 3

    gate = Gate()
    cards = [gate.load_card("wan-tiny")]
    requests = gate.gate_requests(cards, "gate-")
    config = DeployConfig(cards=[CardDeployment(model="wan-tiny")], parallel=ParallelPlan(sp=2))
    if rank == 0:
        gate.assert_requests_vary(cards, requests)
    reference = []
    for request in requests:  # each alone, on a fresh pool
        deployed = deploy_parallel(config)
        if deployed.engine is None:
            deployed.serve()
            continue
        reference.append(run_serially(deployed.engine, [request])[0])
        deployed.shutdown()
    deployed = deploy_parallel(config)
    if deployed.engine is None:
        deployed.serve()
        return {}
    recorder = StepRecorder()
    deployed.engine.observers.append(recorder)
    interleaved = run_concurrently(deployed.engine, requests)
    deployed.shutdown()
    mismatches = []
    for request, ref, got in zip(requests, reference, interleaved):
        assert ref.status == got.status == "completed", (ref.error, got.error)
        try:
            assert_artifacts_identical(ref.artifacts, got.artifacts, what=request.request_id)
        except AssertionError as exc:
            mismatches.append(str(exc))
    batched = {rid for record in recorder.of_kind("diffusion_step") if record.batch_size > 1 for rid in record.request_ids}
    return {"requests": [r.request_id for r in requests], "batched": batched, "mismatches": mismatches,
            "tasks": sorted({r.task.value for r in requests})}


@pytest.fixture(scope="module")
def gate_run() -> dict[str, Any]:
    return spawn(run_gate, 2, timeout_s=600)[0]


def test_interleaved_equals_each_alone_under_sp2(gate_run: dict[str, Any]) -> None:
    assert len(gate_run["requests"]) >= 4
    assert gate_run["mismatches"] == []


def test_every_gate_request_batched_with_another_under_sp2(gate_run: dict[str, Any]) -> None:
    assert set(gate_run["requests"]) == gate_run["batched"]
