"""Checking cross-request batching at mixed step indices (design §6.3).

A request that arrives while another is mid-trajectory must batch with it from its
first denoise step on: per-request scalars (step index, timestep, sigma) travel per
sample, so the batch key names only what must really match. These helpers stagger
arrivals deterministically (each next request is submitted once the previous one
has done ``offset`` steps of the loop) and find the steps that ran alone although
another request was mid-trajectory.
"""

from __future__ import annotations

import asyncio
from typing import AbstractSet as Set, Mapping, Sequence

from fv_kernel.extend.observers import Observer, StepRecord
from fv_kernel.request.request import Request
from fv_kernel.runtime.blocking import run_blocking
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.records import GenerationResult

__all__ = ["StepRecorder", "run_staggered", "unbatched_co_resident"]


class StepRecorder(Observer):
    """An observer that keeps every executed batch's :class:`StepRecord`, in execution order."""

    name = "step-recorder"

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)

    def of_kind(self, kind: str) -> list[StepRecord]:
        return [r for r in self.records if r.kind == kind]


async def run_staggered_async(
    engine: Engine, requests: Sequence[Request], *, loop_id: str | Set[str], offset: int
) -> list[GenerationResult]:
    loops = {loop_id} if isinstance(loop_id, str) else set(loop_id)
    handles = []
    async with engine.running():
        for index, request in enumerate(requests):
            handles.append(engine.submit(request))
            if index + 1 == len(requests):
                break
            async for event in handles[-1].events():
                if event.type == "progress" and event.loop_id in loops and event.step >= offset:
                    break
                if event.type in ("request.completed", "request.failed", "request.cancelled"):
                    break
        return list(await asyncio.gather(*(h.result() for h in handles)))


def run_staggered(
    engine: Engine, requests: Sequence[Request], *, loop_id: str | Set[str], offset: int
) -> list[GenerationResult]:
    """Submit each request once the previous one has done ``offset`` steps of ``loop_id`` (or of
    any loop in a set of ids), or has ended; wait for all."""
    return run_blocking(run_staggered_async(engine, requests, loop_id=loop_id, offset=offset))


def unbatched_co_resident(records: Sequence[StepRecord], total_steps: Mapping[str, int]) -> list[tuple[str, int]]:
    """(request id, step) of every step that ran alone while another request was mid-trajectory.

    ``records`` are one loop kind's executions in order; ``total_steps`` each request's
    step count in that loop. A request is mid-trajectory from its first executed step
    to its last.
    """
    done = {rid: 0 for rid in total_steps}
    started: set[str] = set()
    lonely = []
    for record in records:
        started.update(record.request_ids)
        active = {rid for rid in started if done[rid] < total_steps[rid]}
        if len(record.request_ids) == 1 and len(active) > 1:
            lonely.append((record.request_ids[0], record.steps[0]))
        for rid in record.request_ids:
            done[rid] += 1
    return lonely
