"""A worker's live load: the predicted GPU-seconds of its in-flight requests not yet done, loop by loop."""

from __future__ import annotations

import asyncio

from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart
from fv_dynamo.card import price_request
from fv_dynamo.worker import FvWorker, WorkerOptions


def _request(steps: int) -> Request:
    return Request(request_id=f"load-{steps}", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO,
                   inputs=(TextPart(text="a fox"),), diffusion=DiffusionParams(steps=steps, frames=9, seed=0))


def test_queued_gpu_seconds_follow_each_loop_not_the_last_progress_event(engine) -> None:
    async def scenario() -> list[tuple[str, int, float]]:
        async with engine.running():
            worker = FvWorker(engine, WorkerOptions())
            request = engine.validate(_request(6))
            price = price_request(engine, request)
            handle = worker._submit(request)
            assert abs(worker.queued_gpu_seconds() - price.gpu_seconds) < 1e-9
            seen = []
            async for event in handle.events():
                if event.type == "progress":
                    await asyncio.sleep(0)  # the worker's tracker sees the same event
                    seen.append((event.loop_id, event.step, worker.queued_gpu_seconds()))
            await asyncio.sleep(0)
            assert worker.queued_gpu_seconds() < 1e-9  # every loop done
            worker._done(request.request_id)
            assert worker.load()["queued_gpu_seconds"] == 0
            return seen

    seen = asyncio.run(scenario())
    remaining = [r for _, _, r in seen]
    assert remaining == sorted(remaining, reverse=True)
    # When the one-step text encoder has finished, the denoise and decode work is still queued
    # (a request's last progress event alone, text_encode 1/1, would say it is all done).
    after_encode = next(r for loop, _, r in seen if loop == "text_encode")
    assert after_encode > 0.5 * remaining[0]
