"""A batch that cannot even start fails its own requests, never the scheduler.

Before: ``Engine._run_batch`` raised outside the per-sample isolation (here: the card lists no
components for a task it declares, so the step's op is missing), the exception ended the
scheduling task, and every request in the engine waited forever, including healthy ones.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from fv_kernel.api import Engine, ImagePart, Request, SchedulerConfig, TaskType, TextPart, build_instance
from fv_kernel.testing.toy import toy_card


def _card_without_components_for_i2v():
    card = toy_card("toy-dit")
    caps, i2v = card.capabilities, TaskType.IMAGE_TO_VIDEO
    return card.model_copy(update={
        "capabilities": caps.model_copy(update={"tasks": caps.tasks | {i2v}}),
        "programs": {**card.programs, i2v: card.programs[TaskType.TEXT_TO_VIDEO]},
    })


def test_a_batch_that_cannot_start_fails_only_its_request(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    engine = Engine(SchedulerConfig())
    instance = build_instance(_card_without_components_for_i2v())
    engine.add_instance(instance)
    # The healthy request's components load only once the broken request has failed: loaded earlier,
    # they would build the op the broken step lacks, and whether it failed would depend on timing.
    broken_done = threading.Event()
    load = instance.load_for_task

    def load_after_the_failure(task: TaskType) -> None:
        if task is TaskType.TEXT_TO_VIDEO:
            assert broken_done.wait(60)
        load(task)

    monkeypatch.setattr(instance, "load_for_task", load_after_the_failure)
    broken = Request(model="toy-dit", task=TaskType.IMAGE_TO_VIDEO,
                     inputs=(TextPart(text="x"), ImagePart(image=torch.rand(3, 16, 16))))
    healthy = Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="y"),))

    async def run() -> tuple:
        async with engine.running():
            first = asyncio.ensure_future(engine.generate_async(broken))
            second = asyncio.ensure_future(engine.generate_async(healthy))  # in the engine, waiting for its load
            failed = await asyncio.wait_for(first, 60)
            broken_done.set()
            return failed, await asyncio.wait_for(second, 60)

    failed, completed = asyncio.run(run())
    assert failed.status == "failed" and failed.error.type == "step_failed"
    assert "has no op" in failed.error.message
    assert completed.status == "completed"
