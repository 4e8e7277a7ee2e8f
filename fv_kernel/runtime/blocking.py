"""Running a coroutine to completion from synchronous code.

``asyncio.run(coro)`` keeps ``coro``'s return value as the result of its main task, and on
the way out (CPython 3.11-3.13, main thread) its SIGINT bookkeeping calls
``signal.getsignal``, which formats the handler it installed, ``partial(_on_sigint,
main_task=task)``, with ``%r``: the task's repr includes its result. When that result holds
a finished video, every blocking call paid for formatting the video's tensors, and for a
CUDA tensor also for the device reads that needs (measured: 36 ms for a 61x448x832 video on
the CPU, on every ``run_local`` / ``Engine.generate``). :func:`run_blocking` hands the value
back outside the task, so the task's repr stays a line.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

__all__ = ["run_blocking", "run_in_runner"]

T = TypeVar("T")


async def _into(box: list[Any], coro: Coroutine[Any, Any, T]) -> None:
    box.append(await coro)


def run_in_runner(runner: asyncio.Runner, coro: Coroutine[Any, Any, T]) -> T:
    """``runner.run(coro)``, returning its value without keeping it on the main task."""
    box: list[Any] = []
    runner.run(_into(box, coro))
    return box[0]


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` (a fresh runner), returning its value without keeping it on the main task."""
    with asyncio.Runner() as runner:
        return run_in_runner(runner, coro)
