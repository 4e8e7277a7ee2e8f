"""What the benchmarks time with: each call's milliseconds, by CUDA events on the GPU and by
the wall clock on the CPU. Scripts import it from beside themselves (``bench/`` is on their path)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def timed_calls_ms(fn: Callable[[], Any], device: torch.device, iters: int) -> list[float]:
    """``fn`` called ``iters`` times; each call's time in ms (the caller warms up and syncs first)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times
