"""The Engine's own time per request, first request included, in a fresh process.

    python bench/bench_first_request.py                      # wan-tiny on CPU, 5 requests one after another
    python bench/bench_first_request.py --card wan-tiny --requests 8 --device cuda

One Engine, one resident instance, requests run one at a time. Per request: the scheduler's own
time (``EngineMetrics.scheduler_seconds``: admission, batch choice, hand-back), the loops' host
code (``loop_host_seconds``) and execute time, as deltas of the Engine's metrics. What only the
first request pays shows as the difference between request 0 and the rest.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fv_kernel.api import DiffusionParams, Engine, InstanceOptions, Request, TaskType, TextPart, build_instance
from fv_kernel.runtime.engine import run_concurrently
from fv_wan.cards import wan_cards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="wan-tiny", help="an embedded fv-wan card")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    cards = {c.model_id: c for c in wan_cards() if c.checkpoint.source is None}
    if args.card not in cards:
        raise SystemExit(f"--card: {args.card!r} is not an embedded card; allowed: {', '.join(sorted(cards))}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: --device cuda asked for CUDA, which this machine does not have")
        return 0
    card = cards[args.card]
    d = card.capabilities.defaults
    started = time.perf_counter()
    engine = Engine()
    engine.add_instance(build_instance(card, InstanceOptions(device=args.device)))
    print(f"{card.model_id} on {args.device}, {args.steps} steps at {d.frames}x{d.height}x{d.width}; "
          f"Engine built and instance added in {1e3 * (time.perf_counter() - started):.1f} ms")
    print("| request | scheduler ms | loops' host code ms | execute ms | scheduler / execute |")
    print("|---|---|---|---|---|")
    m = engine.metrics
    for i in range(args.requests):
        before = (m.scheduler_seconds, m.loop_host_seconds, m.execute_seconds)
        request = Request(request_id=f"r{i}", model=card.model_id, task=TaskType.TEXT_TO_VIDEO,
                          inputs=(TextPart(text="a red ball rolls"),), diffusion=DiffusionParams(steps=args.steps, seed=i))
        (result,) = run_concurrently(engine, [request])
        if result.status != "completed":
            raise SystemExit(f"request {i} {result.status}: {result.error}")
        sched, host, execute = (1e3 * (after - b) for after, b in
                                zip((m.scheduler_seconds, m.loop_host_seconds, m.execute_seconds), before))
        print(f"| {i} | {sched:.2f} | {host:.2f} | {execute:.1f} | {100 * sched / execute:.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
