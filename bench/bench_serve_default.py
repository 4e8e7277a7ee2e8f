"""``fv serve`` with its default config: does step-level batching pay where users run it?

Starts the real ``fv serve --config deploy.yaml`` (a subprocess; the config names only the
card, its device, the attention its recipe assumes and an output dir, so scheduling, batching
and budgets are the defaults) on a
card rebuilt on seeded random weights (``bench/random_weights.py``: real size, no download),
and drives it over loopback HTTP:

- **concurrency**: single-frame images (``/v1/images/generations``) one at a time, then from
  ``--clients`` concurrent clients: throughput of each and the ratio;
- **mixed load**: ``--video-clients`` clients sending videos and ``--image-clients`` clients
  sending single-frame images at the same time, under the default config and again under
  ``scheduler.scheduling: request`` (request-level dispatch: one request runs to completion
  before the next starts); the images' p50/p95 latency under each, and the p95 ratio.

The server's ``/metrics`` gives the batches it ran and the op calls it fused. Prints a
markdown table and writes every figure as JSON.

    python bench/bench_serve_default.py out.json --card fastwan2.1-t2v-1.3b --device cuda
    python bench/bench_serve_default.py out.json --card wan-tiny --size 96x64 --video-frames 5 --steps 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml

from fv_kernel.api import ModelCard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_serving import percentile  # noqa: E402
from random_weights import wan_card_for_device  # noqa: E402


def write_card(card_id: str, device: torch.device, where: Path) -> tuple[Path, str]:
    """The card file, and the attention backend its recipe assumes (the deployment must name it)."""
    card: ModelCard | None = wan_card_for_device(card_id, device)
    if card is None:
        raise SystemExit(2)
    path = where / f"{card_id}.json"
    path.write_text(card.model_dump_json(indent=2))
    assumed = card.recipe.assumes_attention
    return path, assumed.kind if assumed is not None else "sdpa"


class Server:
    """``fv serve --config`` in a subprocess, until :meth:`stop`."""

    def __init__(self, card: Path, attention: str, device: str, port: int, where: Path,
                 scheduler: dict[str, Any] | None) -> None:
        config: dict[str, Any] = {
            "cards": [{"model": str(card), "device": device, "attention_backend": attention}], "output_dir": str(where / "out"),
        }
        if scheduler:
            config["scheduler"] = scheduler
        self.config = where / "deploy.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(where / "serve.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fv_kernel.cli.app", "serve", "--config", str(self.config), "--port", str(port),
             "--log-level", "warning"], stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fv serve exited with {self.proc.returncode}:\n{(where / 'serve.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("fv serve did not become healthy in 600 s")

    def metrics(self) -> dict[str, dict[str, float]]:
        from prometheus_client.parser import text_string_to_metric_families

        found: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=30).text):
            if family.name in ("fv_batches", "fv_fused_calls"):
                found[family.name] = {s.labels["size"]: s.value for s in family.samples if s.name.endswith("_total")}
        return found

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def image(client: httpx.AsyncClient, size: str, steps: int | None, seed: int) -> float:
    body: dict[str, Any] = {"prompt": f"a lighthouse at dusk {seed}", "size": size, "seed": seed}
    if steps:
        body["steps"] = steps
    started = time.perf_counter()
    response = await client.post("/v1/images/generations", json=body)
    response.raise_for_status()
    return time.perf_counter() - started


async def video(client: httpx.AsyncClient, size: str, frames: int | None, steps: int | None, seed: int,
                priority: str) -> float:
    body: dict[str, Any] = {"prompt": f"a red fox runs through snow {seed}", "size": size, "seed": seed, "priority": priority}
    if frames:
        body["frames"] = frames
    if steps:
        body["steps"] = steps
    started = time.perf_counter()
    response = await client.post("/v1/videos", json=body)
    response.raise_for_status()
    job = response.json()["id"]
    last = None
    async with client.stream("GET", f"/v1/videos/{job}/events") as stream:
        async for line in stream.aiter_lines():
            if line.startswith("event: "):
                last = line[7:]
    if last != "video.completed":
        raise RuntimeError(f"video {job} ended with {last}")
    return time.perf_counter() - started


async def images_at(url: str, clients: int, per_client: int, args: argparse.Namespace) -> tuple[list[float], float]:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        async def one(c: int) -> list[float]:
            return [await image(client, args.size, args.steps, 1000 * c + i) for i in range(per_client)]

        began = time.perf_counter()
        done = await asyncio.gather(*(one(c) for c in range(clients)))
        return [t for times in done for t in times], time.perf_counter() - began


async def mixed(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Video clients send ``--videos-per-client`` videos each; image clients send images until they are done."""
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=httpx.Limits(max_connections=64)) as client:
        finished = asyncio.Event()
        image_times: list[float] = []

        async def video_client(c: int) -> list[float]:
            return [await video(client, args.video_size, args.video_frames, args.video_steps, 100 * c + i, args.video_priority)
                    for i in range(args.videos_per_client)]

        async def image_client(c: int) -> None:
            i = 0
            while not finished.is_set():
                image_times.append(await image(client, args.size, args.steps, 5000 + 100 * c + i))
                i += 1

        imagers = [asyncio.create_task(image_client(c)) for c in range(args.image_clients)]
        began = time.perf_counter()
        videos = await asyncio.gather(*(video_client(c) for c in range(args.video_clients)))
        wall = time.perf_counter() - began
        finished.set()
        await asyncio.gather(*imagers)
    video_times = [t for times in videos for t in times]
    return {
        "wall_s": wall, "videos": len(video_times), "video_p50_s": statistics.median(video_times),
        "images": len(image_times), "image_p50_s": statistics.median(image_times),
        "image_p95_s": percentile(image_times, 0.95),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--card", default="fastwan2.1-t2v-1.3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--port", type=int, default=8417)
    parser.add_argument("--size", default="832x480", help="image size, WIDTHxHEIGHT")
    parser.add_argument("--steps", type=int, default=None, help="image and video steps (default: the card's)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--images", type=int, default=32, help="images per cell of the concurrency section")
    parser.add_argument("--video-size", default="832x480")
    parser.add_argument("--video-frames", type=int, default=None, help="default: the card's")
    parser.add_argument("--video-steps", type=int, default=None, help="default: the card's")
    parser.add_argument("--video-clients", type=int, default=2)
    parser.add_argument("--videos-per-client", type=int, default=3)
    parser.add_argument("--image-clients", type=int, default=4)
    parser.add_argument("--video-priority", default="interactive", choices=["interactive", "batch"],
                        help="the videos' scheduling class (the images are interactive)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["concurrency", "mixed"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result: dict[str, Any] = {
        "card": args.card, "device": str(device), "date": date.today().isoformat(), "torch": torch.__version__,
        "python": platform.python_version(), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "args": {k: v for k, v in vars(args).items() if k != "output"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        card, attention = write_card(args.card, device, where)
        runs: list[tuple[str, dict[str, Any] | None]] = [("default", None)]
        if "mixed" not in args.skip:
            runs.append(("request-level", {"scheduling": "request"}))
        for name, scheduler in runs:
            run_dir = where / name
            run_dir.mkdir()
            server = Server(card, attention, args.device, args.port, run_dir, scheduler)
            try:
                asyncio.run(images_at(server.url, 1, 2, args))  # warm-up: first-use loading, allocator growth
                row: dict[str, Any] = {}
                if name == "default" and "concurrency" not in args.skip:
                    alone, alone_wall = asyncio.run(images_at(server.url, 1, args.images, args))
                    together, together_wall = asyncio.run(
                        images_at(server.url, args.clients, max(1, args.images // args.clients), args))
                    row["one_at_a_time_rps"] = len(alone) / alone_wall
                    row["concurrent_rps"] = len(together) / together_wall
                    row["speedup"] = row["concurrent_rps"] / row["one_at_a_time_rps"]
                    row["concurrent_p50_s"] = statistics.median(together)
                    print(f"{args.card} single-frame {args.size}: {row['one_at_a_time_rps']:.2f} req/s one at a time, "
                          f"{row['concurrent_rps']:.2f} from {args.clients} clients ({row['speedup']:.2f}x)", file=sys.stderr)
                if "mixed" not in args.skip:
                    row["mixed"] = asyncio.run(mixed(server.url, args))
                    print(f"{name}: mixed load {row['mixed']}", file=sys.stderr)
                row["metrics"] = server.metrics()
                result[name] = row
            finally:
                server.stop()
    if "mixed" not in args.skip:
        result["image_p95_ratio"] = result["request-level"]["mixed"]["image_p95_s"] / result["default"]["mixed"]["image_p95_s"]
    args.output.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("args",)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
