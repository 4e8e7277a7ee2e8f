"""Step-level vs request-level scheduling on the real fv-wan loops (``wan-tiny``, CPU).

N text-to-video requests arrive as a seeded Poisson process (real time, ``--rate`` per
second) at one engine holding one wan-tiny instance; each runs the card's real loops
(UMT5 text encode through the feature cache, the denoise loop with CFG, the causal VAE
decode). The same arrival schedule runs under each mode, modes interleaved within a
repeat so slow phases of a shared machine hit them alike:

- ``step:throughput``: step-level scheduling, compatible steps of different requests
  fused into one call (requests at different step indices batch: the step index travels
  per sample);
- ``request:throughput``: request-level dispatch (one request runs to completion before
  the next starts; nothing to batch with);
- ``step:exact``: step-level scheduling, but batches of non-batch-invariant ops run per
  sample (bit-identical to serial), so batching saves no compute.

Reported per run: throughput (requests per second of makespan), p50/p95 latency (submit
to completion), denoise steps per executed batch, and the fraction of co-resident denoise
steps that batched (see ``bench_scheduler.batching_stats``), plus the busy seconds of each
step kind (where the time goes). The denoise loop uses ``cfg_dispatch: batched`` (the two
CFG rows in one forward; the card's default, ``sequential``, loops over rows inside a fused
call, so fusion would buy nothing).

Usage: python bench/bench_steps_wan.py OUT.json [--requests 16] [--rate 1.0] [--repeats 3]
Prints markdown tables; writes all numbers to OUT.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench_scheduler import batching_stats, fraction, machine, percentile
from fv_kernel.api import (
    DiffusionParams,
    Engine,
    ModelInstance,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    build_instance,
)
from fv_kernel.testing.batching import StepRecorder
from fv_wan.cards import wan_cards

MODES = ("step:throughput", "request:throughput", "step:exact")


def wan_tiny(cfg_dispatch: str) -> ModelInstance:
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    loops = dict(card.loops)
    loops["denoise"] = loops["denoise"].model_copy(update={"config": {**loops["denoise"].config, "cfg_dispatch": cfg_dispatch}})
    return build_instance(card.model_copy(update={"loops": loops}))


def make_request(tag: str, i: int, args: argparse.Namespace) -> Request:
    return Request(
        request_id=f"{tag}-{i}", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text=f"a red fox running through fresh snow, take {i}"), TextPart(text="blurry", role="negative_prompt")),
        diffusion=DiffusionParams(seed=i, steps=args.steps, height=args.height, width=args.width, frames=args.frames, guidance=5.0),
    )


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def run(instance: ModelInstance, mode: str, schedule: list[float], seed: int, args: argparse.Namespace) -> dict[str, Any]:
    scheduling, batching = mode.split(":")
    recorder = StepRecorder()
    engine = Engine(SchedulerConfig(scheduling=scheduling, batching=batching), observers=[recorder])  # type: ignore[arg-type]
    engine.add_instance(instance)
    requests = [make_request(f"s{seed}", i, args) for i in range(len(schedule))]
    latencies: list[float] = []

    async def one(request: Request) -> None:
        submitted = time.perf_counter()
        result = await engine.submit(request).result()
        result.raise_for_status()
        latencies.append(time.perf_counter() - submitted)

    async def go() -> float:
        async with engine.running():
            start = time.perf_counter()
            tasks = []
            for at, request in zip(schedule, requests):
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(request)))
            await asyncio.gather(*tasks)
            return time.perf_counter() - start

    makespan = asyncio.run(go())
    denoise = recorder.of_kind("diffusion_step")
    busy: dict[str, float] = {}
    for record in recorder.records:
        busy[record.kind] = busy.get(record.kind, 0.0) + record.wall_seconds
    return {
        "mode": mode, "seed": seed, "requests": len(requests), "makespan_s": makespan,
        "throughput_per_s": len(requests) / makespan, "p50_s": percentile(latencies, 0.5),
        "p95_s": percentile(latencies, 0.95), "mean_s": statistics.fmean(latencies),
        "denoise": batching_stats(denoise, {r.request_id: args.steps for r in requests}),
        "busy_s": busy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--repeats", type=int, default=3, help="arrival schedules (seeds seed, seed+1, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--cfg-dispatch", choices=("batched", "sequential"), default="batched")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    torch.set_num_threads(1)

    instance = wan_tiny(args.cfg_dispatch)
    # Warm up every loop once (component loads, tokenizer, first-call allocations) before timing.
    warm = Engine(SchedulerConfig())
    warm.add_instance(instance)
    warm.generate(make_request("warmup", 0, args)).raise_for_status()
    start = time.perf_counter()
    warm.generate(make_request("alone", 1, args)).raise_for_status()
    alone_s = time.perf_counter() - start

    runs = []
    for rep in range(args.repeats):
        schedule = arrivals(args.requests, args.rate, args.seed + rep)
        for mode in args.modes:
            runs.append(run(instance, mode, schedule, args.seed + rep, args))
            print(f"seed {args.seed + rep} {mode}: {runs[-1]['throughput_per_s']:.3f} req/s", file=sys.stderr, flush=True)

    summary = {}
    for mode in args.modes:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            key: statistics.median(r[key] for r in mine) for key in ("throughput_per_s", "p50_s", "p95_s")
        } | {
            "mean_batch_size": statistics.median(r["denoise"]["mean_batch_size"] for r in mine),
            "batched_fraction": None if any(r["denoise"]["batched_fraction"] is None for r in mine)
            else statistics.median(r["denoise"]["batched_fraction"] for r in mine),
        }
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv),
        "load": {k: v for k, v in vars(args).items() if k != "out"}, "one_request_alone_s": alone_s,
        "runs": runs, "median": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))

    print(f"{result['date']}, {result['machine']}")
    print(f"`{result['command']}`; one request alone (warm): {alone_s:.2f} s")
    print()
    print("| seed | mode | throughput (req/s) | p50 (s) | p95 (s) | denoise steps per batch | co-resident denoise steps batched "
          "| busy s: encode / denoise / decode |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        d, b = r["denoise"], r["busy_s"]
        print(f"| {r['seed']} | {r['mode']} | {r['throughput_per_s']:.3f} | {r['p50_s']:.2f} | {r['p95_s']:.2f} "
              f"| {d['mean_batch_size']:.2f} | {fraction(d['batched_fraction'])} "
              f"| {b.get('encoder_chunk', 0):.1f} / {b.get('diffusion_step', 0):.1f} / {b.get('vae_tile', 0):.1f} |")
    print()
    print("Median over repeats:")
    print()
    print("| mode | throughput (req/s) | p50 (s) | p95 (s) | denoise steps per batch | co-resident denoise steps batched |")
    print("|---|---|---|---|---|---|")
    for mode, m in summary.items():
        print(f"| {mode} | {m['throughput_per_s']:.3f} | {m['p50_s']:.2f} | {m['p95_s']:.2f} | {m['mean_batch_size']:.2f} "
              f"| {fraction(m['batched_fraction'])} |")


if __name__ == "__main__":
    main()
