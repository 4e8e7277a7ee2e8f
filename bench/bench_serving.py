"""Serving benchmark: throughput and p50/p95 latency of ``POST /v1/videos`` -> completed, over loopback.

For each scheduling mode (step-level vs request-level) and each client concurrency, a
fresh server (real uvicorn on 127.0.0.1, free port) takes ``--requests`` jobs from
``concurrency`` client tasks; each task creates a job and follows its SSE stream to the
end. Latency is create -> ``video.completed`` (MP4 written). Prints a markdown table and
writes the numbers as JSON.

    python bench/bench_serving.py bench-serving.json --card toy-dit --requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from fv_kernel.model.instance import ModelInstance, build_instance
from fv_kernel.config import DeployConfig
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.serving import ServerThread, create_app


def build_card_instance(card_id: str) -> ModelInstance:
    from fv_kernel.testing.toy import toy_card, toy_cards

    if card_id in {c.model_id for c in toy_cards()}:
        return build_instance(toy_card(card_id))
    from fv_kernel.model.catalog import CardCatalog
    from fv_kernel.plugins.host import PluginHost

    return build_instance(CardCatalog(PluginHost()).get(card_id))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def drive(url: str, requests: int, concurrency: int, body: dict[str, Any]) -> tuple[list[float], float, int]:
    latencies: list[float] = []
    rejected = 0
    next_index = 0

    async def client_task(client: httpx.AsyncClient) -> None:
        nonlocal next_index, rejected
        while next_index < requests:
            next_index += 1
            started = time.perf_counter()
            response = await client.post("/v1/videos", json=body)
            if response.status_code == 429:
                rejected += 1
                continue
            response.raise_for_status()
            job_id = response.json()["id"]
            last = None
            async with client.stream("GET", f"/v1/videos/{job_id}/events") as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("event: "):
                        last = line[7:]
            if last != "video.completed":
                raise RuntimeError(f"job {job_id} ended with {last}")
            latencies.append(time.perf_counter() - started)

    limits = httpx.Limits(max_connections=2 * concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        began = time.perf_counter()
        await asyncio.gather(*(client_task(client) for _ in range(concurrency)))
        wall = time.perf_counter() - began
    return latencies, wall, rejected


def run_one(card_id: str, scheduling: str, concurrency: int, requests: int, body: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        config = DeployConfig(output_dir=Path(out), scheduler=SchedulerConfig(scheduling=scheduling, max_queue=4096))  # type: ignore[arg-type]
        engine = Engine(config.scheduler, limits=config.limits)
        engine.add_instance(build_card_instance(card_id))
        server = ServerThread(create_app(engine, config)).start()
        try:
            # Warm-up: first-use loading and allocator growth stay out of the numbers.
            asyncio.run(drive(server.url, 2, 1, body))
            latencies, wall, rejected = asyncio.run(drive(server.url, requests, concurrency, body))
            batches = dict(sorted(engine.metrics.batches_by_size.items()))
        finally:
            server.stop()
    return {
        "scheduling": scheduling, "concurrency": concurrency, "requests": len(latencies), "rejected": rejected,
        "wall_s": wall, "throughput_rps": len(latencies) / wall,
        "p50_s": statistics.median(latencies), "p95_s": percentile(latencies, 0.95), "batches_by_size": batches,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="where to write the JSON results")
    parser.add_argument("--card", default="toy-dit", help="card id (toy cards are built in-process)")
    parser.add_argument("--requests", type=int, default=64, help="jobs per (scheduling, concurrency) cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=None, help="denoise steps per job (default: the card's)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    body: dict[str, Any] = {"prompt": "a lighthouse at dusk, waves", "seed": 0}
    if args.steps:
        body["steps"] = args.steps
    rows = []
    for scheduling in ("step", "request"):
        for concurrency in args.concurrency:
            row = run_one(args.card, scheduling, concurrency, args.requests, body)
            rows.append(row)
            print(f"  {scheduling:>7} c={concurrency:<3} {row['throughput_rps']:.2f} req/s", file=sys.stderr)
    result = {
        "card": args.card, "requests_per_cell": args.requests, "steps": args.steps, "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(), "rows": rows,
    }
    args.output.write_text(json.dumps(result, indent=2))
    print(f"\n{args.card}, {args.requests} jobs per cell, HTTP loopback (create -> SSE video.completed)\n")
    print("| scheduling | concurrency | throughput (req/s) | p50 latency (s) | p95 latency (s) | batches by size |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['scheduling']} | {row['concurrency']} | {row['throughput_rps']:.2f} | {row['p50_s']:.3f} | "
              f"{row['p95_s']:.3f} | {row['batches_by_size']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
