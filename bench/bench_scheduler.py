"""Scheduler benchmarks on a fake pool (no GPU).

1. Overhead per WorkUnit at 1, 16 and 64 concurrent requests: steps cost nothing, so
   everything measured is the runtime (driver, scheduler, batching, executor hand-off).
2. A mixed-load simulation whose step costs come from the reference implementation's
   measured H200 step times (the profile below; scaled down in time by ``--time-scale``),
   comparing step-level scheduling with request-level dispatch: long video jobs,
   single-frame image jobs and short AR jobs arriving as a seeded Poisson process.
   Besides throughput and latency, each class reports how its steps batched: the mean
   batch size, and the fraction of its co-resident steps (run while another request of
   the class was mid-trajectory) that ran in a batch of more than one.

The same measurement on the real fv-wan loops (wan-tiny on CPU) is ``bench_steps_wan.py``.

Usage: python bench/bench_scheduler.py OUT.json [--time-scale 0.05] [--horizon 1200] [--repeats 1]
Prints markdown tables; writes all numbers to OUT.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from fv_kernel.model.instance import build_instance
from fv_kernel.extend.observers import StepRecord
from fv_kernel.request.request import ARParams, DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.batching import BatchPolicy
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.testing.batching import StepRecorder
from fv_kernel.testing.fake_pool import fake_card

# --- the profile (seconds on one H200, bf16, Wan2.1-1.3B; gpu-baseline.md) -----------------
VIDEO_STEP_S = 1.200  # 480x832x81 with CFG as batch 2
VIDEO_STEPS = 50
IMAGE_STEP_S = {1: 0.0387, 8: 0.1107, 32: 0.4277}  # single-frame 480x832 forward by batch size
IMAGE_STEPS = 30
# Assumption (no measured figure in the profile): an AR decode token of a ~16B reasoner,
# memory-bound, ~15 ms alone and ~10% more per 8x batch.
AR_TOKEN_S = {1: 0.015, 8: 0.0165, 32: 0.021}
AR_TOKENS = 32


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def machine() -> str:
    """The machine in words: logical CPUs, CPU model, Python and torch versions."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({model}), python {platform.python_version()}, torch {torch.__version__}"


def batching_stats(records: Sequence[StepRecord], total_steps: Mapping[str, int]) -> dict[str, Any]:
    """How one loop's steps batched, from its executed batches (in order) and each request's step count.

    ``mean_batch_size``: steps per executed batch. A step is *co-resident* when another request
    was mid-trajectory in the same loop (between its first and last executed step) as it ran;
    ``batched_fraction`` is the share of co-resident steps that ran in a batch of more than one
    (None when no step was co-resident, as under request-level scheduling).
    """
    done = {rid: 0 for rid in total_steps}
    started: set[str] = set()
    co_resident = batched = steps = 0
    for record in records:
        started.update(record.request_ids)
        active = {rid for rid in started if done[rid] < total_steps[rid]}
        steps += record.batch_size
        if len(active) > 1:
            co_resident += record.batch_size
            if record.batch_size > 1:
                batched += record.batch_size
        for rid in record.request_ids:
            done[rid] += 1
    return {
        "steps": steps, "batches": len(records), "mean_batch_size": steps / len(records) if records else float("nan"),
        "co_resident_steps": co_resident, "co_resident_batched": batched,
        "batched_fraction": batched / co_resident if co_resident else None,
    }


def fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


# --------------------------------------------------------------------------- overhead


def overhead(concurrency: int, steps: int) -> dict[str, float]:
    engine = Engine(SchedulerConfig(max_running_requests=max(concurrency, 1), batching="throughput",
                                    batch=BatchPolicy(max_batch_size=128)))
    engine.add_instance(build_instance(fake_card("fake-video", step_seconds=1e-3)))
    requests = [
        Request(model="fake-video", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                diffusion=DiffusionParams(steps=steps, seed=i))
        for i in range(concurrency)
    ]

    async def go() -> float:
        async with engine.running():
            start = time.perf_counter()
            handles = [engine.submit(r) for r in requests]
            await asyncio.gather(*(h.result() for h in handles))
            return time.perf_counter() - start

    wall = asyncio.run(go())
    units = concurrency * steps
    return {
        "concurrency": concurrency,
        "units": units,
        "batches": sum(engine.metrics.batches_by_size.values()),
        "wall_us_per_unit": 1e6 * wall / units,
        "overhead_us_per_unit": 1e6 * (wall - engine.metrics.execute_seconds) / units,
        "scheduler_us_per_unit": 1e6 * engine.metrics.scheduler_seconds / units,
    }


# --------------------------------------------------------------------------- mixed load


def scaled(profile: dict[int, float], scale: float) -> dict[int, float]:
    return {b: s * scale for b, s in profile.items()}


def arrivals(horizon: float, seed: int, rates: dict[str, float]) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    events = []
    for klass, rate in rates.items():
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= horizon:
                break
            events.append((t, klass))
    return sorted(events)


def mixed(mode: str, scale: float, horizon: float, seed: int, rates: dict[str, float]) -> dict[str, Any]:
    config = SchedulerConfig(
        scheduling=mode, batching="throughput", max_running_requests=256, max_queue=10_000,
        batch=BatchPolicy(max_batch_size=32, max_interleave_ratio=0.2),
    )
    recorder = StepRecorder()
    engine = Engine(config, observers=[recorder])
    engine.add_instance(build_instance(fake_card(
        "video", step_seconds=VIDEO_STEP_S * scale, cost_profile={1: VIDEO_STEP_S * scale}, batchable=False)))
    engine.add_instance(build_instance(fake_card(
        "image", step_seconds=IMAGE_STEP_S[1] * scale, cost_profile=scaled(IMAGE_STEP_S, scale))))
    engine.add_instance(build_instance(fake_card(
        "ar", loop_kind="ar_decode", step_seconds=AR_TOKEN_S[1] * scale, cost_profile=scaled(AR_TOKEN_S, scale))))
    schedule = arrivals(horizon, seed, rates)

    def make(i: int, klass: str) -> Request:
        if klass == "ar":
            return Request(request_id=f"{klass}{i}", model="ar", task=TaskType.TEXT_GENERATION,
                           inputs=(TextPart(text="x"),), ar=ARParams(max_tokens=AR_TOKENS, seed=i))
        steps = VIDEO_STEPS if klass == "video" else IMAGE_STEPS
        return Request(request_id=f"{klass}{i}", model=klass, task=TaskType.TEXT_TO_VIDEO,
                       inputs=(TextPart(text="x"),), diffusion=DiffusionParams(steps=steps, seed=i))

    latencies: dict[str, list[float]] = {"video": [], "image": [], "ar": []}

    async def one(request: Request, klass: str) -> None:
        submitted = time.perf_counter()
        result = await engine.submit(request).result()
        assert result.status == "completed", result.error
        latencies[klass].append((time.perf_counter() - submitted) / scale)

    async def go() -> float:
        async with engine.running():
            start = time.perf_counter()
            tasks = []
            for i, (at, klass) in enumerate(schedule):
                delay = start + at * scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(make(i, klass), klass)))
            await asyncio.gather(*tasks)
            return (time.perf_counter() - start) / scale

    makespan = asyncio.run(go())
    out: dict[str, Any] = {"mode": mode, "seed": seed, "makespan_s": makespan, "jobs": len(schedule)}
    class_of = {inst.instance_id: klass for klass, inst in engine.instances.items()}
    steps_of = {"video": VIDEO_STEPS, "image": IMAGE_STEPS, "ar": AR_TOKENS}
    for klass, values in latencies.items():
        records = [r for r in recorder.records if class_of[r.instance_id] == klass]
        total = {f"{k}{i}": steps_of[k] for i, (_, k) in enumerate(schedule) if k == klass}
        out[klass] = {
            "jobs": len(values), "throughput_per_s": len(values) / makespan,
            "p50_s": percentile(values, 0.5), "p95_s": percentile(values, 0.95),
            "mean_s": statistics.fmean(values) if values else float("nan"),
            "batching": batching_stats(records, total),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--time-scale", type=float, default=0.05, help="real seconds per simulated second")
    parser.add_argument("--horizon", type=float, default=1200.0, help="simulated seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="arrival schedules (seeds seed, seed+1, ...) per mode")
    parser.add_argument("--overhead-steps", type=int, default=200)
    parser.add_argument("--overhead-only", action="store_true", help="skip the mixed-load simulation")
    args = parser.parse_args()
    torch.set_num_threads(1)

    over = [overhead(c, args.overhead_steps) for c in (1, 16, 64)]
    rates = {"video": 0.005, "image": 0.3, "ar": 0.3}
    runs = [] if args.overhead_only else [
        mixed(mode, args.time_scale, args.horizon, args.seed + rep, rates)
        for rep in range(args.repeats) for mode in ("step", "request")
    ]
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv),
        "overhead": over, "mixed": {"rates_per_s": rates, "time_scale": args.time_scale, "horizon_s": args.horizon, "runs": runs},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    print("| concurrent requests | WorkUnits | batches | overhead per WorkUnit (µs) | of which scheduler (µs) |")
    print("|---|---|---|---|---|")
    for o in over:
        print(f"| {o['concurrency']} | {o['units']} | {o['batches']} | {o['overhead_us_per_unit']:.1f} | {o['scheduler_us_per_unit']:.1f} |")
    if not runs:
        return
    print()
    print("| seed | scheduling | class | jobs | throughput (jobs/s) | p50 latency (s) | p95 latency (s) "
          "| mean batch size | co-resident steps batched |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        for klass in ("video", "image", "ar"):
            c = run[klass]
            b = c["batching"]
            print(f"| {run['seed']} | {run['mode']} | {klass} | {c['jobs']} | {c['throughput_per_s']:.3f} | {c['p50_s']:.2f} "
                  f"| {c['p95_s']:.2f} | {b['mean_batch_size']:.2f} | {fraction(b['batched_fraction'])} |")
    print()
    for step, req in zip(runs[0::2], runs[1::2]):
        print(f"seed {step['seed']}: image p95 request-level / step-level = {req['image']['p95_s'] / step['image']['p95_s']:.1f}x; "
              f"video p95 step-level / request-level = {step['video']['p95_s'] / req['video']['p95_s']:.2f}x")


if __name__ == "__main__":
    main()
