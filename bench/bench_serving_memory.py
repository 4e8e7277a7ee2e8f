"""Serving memory benchmark: the RSS of a real ``fv serve`` process over many finished jobs, and after DELETE.

Starts ``fv serve`` (a subprocess, the real CLI) on a fresh data dir, runs ``--warmup``
jobs (lazy weight loads, allocator pools), then ``--jobs`` tiny jobs from ``--concurrency``
clients, each following its SSE stream to ``video.completed``. The server's resident set
size (``VmRSS`` of ``/proc/<pid>/status``) is sampled before, every ``--sample-every`` jobs,
after the jobs, and after every job is DELETEd. Acceptance (issue 13): growth over the
jobs under 150 MB, and none after DELETE. Prints a markdown summary and writes JSON.

    python bench/bench_serving_memory.py memory.json --card wan-tiny --jobs 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

MB = 1e6
ACCEPTED_GROWTH_MB = 150.0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run_jobs(client: httpx.AsyncClient, count: int, concurrency: int, body: dict[str, Any],
                   on_done: Any = None) -> list[str]:
    ids: list[str] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            next_index += 1
            response = await client.post("/v1/videos", json=body)
            response.raise_for_status()
            job_id = response.json()["id"]
            last = None
            async with client.stream("GET", f"/v1/videos/{job_id}/events") as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("event: "):
                        last = line[7:]
            if last != "video.completed":
                raise RuntimeError(f"job {job_id} ended with {last}")
            ids.append(job_id)
            if on_done is not None:
                on_done(len(ids))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ids


async def measure(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    width, height = (int(v) for v in args.size.split("x"))
    body = {"model": args.card, "prompt": "a red fox", "size": args.size, "frames": args.frames,
            "steps": args.steps, "seed": 7}
    samples: list[tuple[int, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        warm = await run_jobs(client, args.warmup, args.concurrency, body)
        for job_id in warm:
            (await client.delete(f"/v1/videos/{job_id}")).raise_for_status()
        baseline = rss_bytes(pid)
        samples.append((0, baseline / MB))

        def sample(done: int) -> None:
            if done % args.sample_every == 0:
                samples.append((done, rss_bytes(pid) / MB))

        began = time.perf_counter()
        ids = await run_jobs(client, args.jobs, args.concurrency, body, on_done=sample)
        wall = time.perf_counter() - began
        after_jobs = rss_bytes(pid)
        for job_id in ids:
            (await client.delete(f"/v1/videos/{job_id}")).raise_for_status()
        after_delete = rss_bytes(pid)
        listed = (await client.get("/v1/videos", params={"limit": 1})).json()["data"]
    return {
        "card": args.card, "size": f"{width}x{height}", "frames": args.frames, "steps": args.steps,
        "jobs": len(ids), "warmup": args.warmup, "concurrency": args.concurrency, "wall_s": wall,
        "rss_baseline_mb": baseline / MB, "rss_after_jobs_mb": after_jobs / MB, "rss_after_delete_mb": after_delete / MB,
        "growth_over_jobs_mb": (after_jobs - baseline) / MB, "growth_after_delete_mb": (after_delete - after_jobs) / MB,
        "jobs_left_after_delete": len(listed), "samples": samples,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPU(s), Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="JSON file for the results")
    parser.add_argument("--card", default="wan-tiny")
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--size", default="16x16", help="WxH (wan-tiny's smallest: 16x16)")
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--sample-every", type=int, default=100)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="fv-bench-memory-") as tmp:
        port = free_port()
        config = Path(tmp) / "deploy.yaml"
        config.write_text(f"output_dir: {Path(tmp) / 'out'}\nserver:\n  port: {port}\n")
        server = subprocess.Popen(
            [sys.executable, "-m", "fv_kernel.cli.app", "serve", "--config", str(config), "--model", args.card,
             "--log-level", "warning"],
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"fv serve exited with {server.returncode}")
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("fv serve did not answer /health within 300 s")
                time.sleep(0.2)
            result = asyncio.run(measure(args, url, server.pid))
        finally:
            server.terminate()
            server.wait(60)
    args.output.write_text(json.dumps(result, indent=2))
    ok = result["growth_over_jobs_mb"] < ACCEPTED_GROWTH_MB and result["growth_after_delete_mb"] <= 0
    print(f"| card | jobs | RSS before | after {result['jobs']} jobs | after DELETE | growth | wall |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {result['card']} {result['size']}x{result['frames']}f {result['steps']} step(s) | {result['jobs']} "
          f"| {result['rss_baseline_mb']:.0f} MB | {result['rss_after_jobs_mb']:.0f} MB | {result['rss_after_delete_mb']:.0f} MB "
          f"| {result['growth_over_jobs_mb']:+.0f} MB | {result['wall_s']:.0f} s |")
    print(f"samples (jobs, MB): {[(n, round(mb)) for n, mb in result['samples']]}")
    print("PASS" if ok else f"FAIL: growth must stay under {ACCEPTED_GROWTH_MB:.0f} MB and not grow after DELETE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
