"""Killing one rank mid-request (2 gloo processes, sp=2): the requests in flight fail with a
clear RankFailure, a request submitted afterwards fails at once with the same error instead of
hanging, and rank 0's engine keeps running (it answers and stops normally)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from fv_kernel.parallel.launch import spawn

STEPS = 8


def run_and_kill(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from fv_kernel.api import DiffusionParams, Observer, Request, TaskType, TextPart, run_concurrently, run_serially
    from fv_kernel.config import CardDeployment, DeployConfig
    from fv_kernel.parallel import ParallelPlan
    from fv_kernel.deploy.parallel import deploy_parallel

    config = DeployConfig(cards=[CardDeployment(model="wan-tiny")], parallel=ParallelPlan(sp=2, timeout_s=120))
    deployed = deploy_parallel(config)
    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if deployed.engine is None:
        deployed.serve()  # killed by rank 0 part-way
        return {"worker_returned": True}

    class KillWorker(Observer):
        name = "kill-worker"

        def __init__(self) -> None:
            self.denoise_steps = 0
            self.killed_at: float | None = None

        def on_step(self, record: Any) -> None:
            if record.kind == "diffusion_step":
                self.denoise_steps += 1
                if self.denoise_steps == 2 and self.killed_at is None:
                    os.kill(pids[1], signal.SIGKILL)
                    self.killed_at = time.monotonic()

    killer = KillWorker()
    deployed.engine.observers.append(killer)
    requests = [
        Request(request_id=f"k{i}", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=f"a fox {i}"),),
                diffusion=DiffusionParams(seed=i, steps=STEPS, height=32, width=32, frames=5))
        for i in range(2)
    ]
    results = run_concurrently(deployed.engine, requests)
    failed_after = time.monotonic() - (killer.killed_at or time.monotonic())
    started = time.monotonic()
    later = run_serially(deployed.engine, [requests[0].model_copy(update={"request_id": "after"})])[0]
    return {
        "statuses": [r.status for r in results], "errors": [r.error for r in results],
        "later": (later.status, later.error), "later_seconds": time.monotonic() - started,
        "failed_after_kill_s": failed_after, "steps_before_kill": killer.denoise_steps,
    }


@pytest.fixture(scope="module")
def killed() -> dict[str, Any]:
    return spawn(run_and_kill, 2, timeout_s=600, allow_dead=frozenset({1}))[0]


def _message(error: Any) -> str:
    return error.message if hasattr(error, "message") else str(error)


def test_requests_in_flight_fail_with_a_clear_rank_failure(killed: dict[str, Any]) -> None:
    assert killed["statuses"] == ["failed", "failed"], killed
    for error in killed["errors"]:
        text = _message(error)
        assert "parallel pool failed during op 'dit_forward:transformer'" in text, text
        assert "a rank died or a collective failed" in text and "restarted" in text
        assert getattr(error, "type", "rank_failure") == "rank_failure", error
    assert killed["failed_after_kill_s"] < 30  # the collective's timeout bounds it; a dead peer is usually seen at once


def test_a_later_request_fails_at_once_instead_of_hanging(killed: dict[str, Any]) -> None:
    status, error = killed["later"]
    assert status == "failed" and "parallel pool failed" in _message(error)
    assert killed["later_seconds"] < 10
