#!/usr/bin/env python3
"""Cost-aware routing against round-robin: p95 latency by request class on a mixed load.

Two fv workers (``fv worker``, wan-tiny, CPU, one intra-op thread each) on 127.0.0.1 with
Dynamo's file discovery; no frontend (both policies route on Dynamo's client, so the HTTP
layer is the same for both and left out). The load is one fixed schedule (seeded) of
images, short videos and long videos arriving open-loop; each policy replays the same
schedule on a fresh pair of workers (warmed by one request of each class first), ``--rounds``
times with the policies' order alternating (a shared machine's load drifts); latencies are
pooled per policy and class.

- ``round_robin``: Dynamo's ``Client.round_robin`` on each endpoint (videos, images).
- ``cost``: :class:`fv_dynamo.router.CostAwareRouter` (least queued + quoted GPU-seconds, on ``Client.direct``).

    python bench/bench_fleet_routing.py                      # the recorded run
    python bench/bench_fleet_routing.py --requests 24 --rate 1.0 --json out.json
    python bench/bench_fleet_routing.py --mode gpu-sleep       # steps sleep: each worker its own device

``--mode gpu-sleep`` serves the test-only ``gpu-sleep`` card (plugins/fv-dynamo/tests/fixtures/
fv-gpu-sleep, put on the workers' PYTHONPATH, never installed): a step sleeps its declared
GPU-seconds, which releases the CPU, so the two workers do not contend as wan-tiny's do; the
classes differ 20x in cost (image 0.1, short video 0.3, long video 2.0 GPU-seconds).

Latency is from the moment a request is due (its arrival time) to its last chunk. Needs
fv-dynamo with Dynamo installed (plugins/fv-dynamo/README.md); CPU only (it sets no device).
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
import tempfile
import time
from pathlib import Path
from typing import Any

#: Request classes per mode: the Dynamo endpoint kind, and fv's fields (the passthrough).
MODES: dict[str, dict[str, Any]] = {
    # wan-tiny at its default 96x64, on CPU: both workers share the machine's cores.
    "wan-tiny": {"model": "wan-tiny", "classes": {
        "image": {"kind": "images", "fields": {"steps": 4}},
        "video-short": {"kind": "videos", "fields": {"frames": 9, "steps": 4}},
        "video-long": {"kind": "videos", "fields": {"frames": 33, "steps": 16}},
    }},
    # The test-only gpu-sleep card (plugins/fv-dynamo/tests/fixtures/fv-gpu-sleep): each step sleeps its
    # declared 0.05 GPU-seconds, so each worker is a device of its own, as on a GPU fleet.
    "gpu-sleep": {"model": "gpu-sleep", "classes": {
        "image": {"kind": "images", "fields": {"steps": 2}},             # 0.1 GPU-s
        "video-short": {"kind": "videos", "fields": {"frames": 4, "steps": 6}},   # 0.3 GPU-s
        "video-long": {"kind": "videos", "fields": {"frames": 16, "steps": 40}},  # 2.0 GPU-s
    }},
}
CLASSES: dict[str, dict[str, Any]] = MODES["wan-tiny"]["classes"]
MIX = {"image": 0.5, "video-short": 0.3, "video-long": 0.2}


def schedule(n: int, rate: float, seed: int) -> list[tuple[float, str]]:
    """``n`` (arrival second, class) pairs: Poisson arrivals at ``rate``/s, classes drawn by MIX."""
    rng = random.Random(seed)
    t, out = 0.0, []
    names, weights = zip(*MIX.items())
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, rng.choices(names, weights)[0]))
    return out


def payload(name: str, i: int, mode: str = "wan-tiny") -> dict[str, Any]:
    return {"model": MODES[mode]["model"], "prompt": "a red circle moves left",
            "extra_args": {"media_passthrough": {**MODES[mode]["classes"][name]["fields"], "seed": i}}}


async def drain(stream: Any) -> list[Any]:
    return [item async for item in stream]


async def run_policy(policy: str, plan: list[tuple[float, str]], store: Path, mode: str = "wan-tiny") -> dict[str, list[float]]:
    """Replay ``plan`` under ``policy`` on the running workers; latencies by class, and ``_makespan``."""
    from dynamo.runtime import DistributedRuntime

    from fv_dynamo.router import CostAwareRouter

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    try:
        router = CostAwareRouter(runtime, namespace="fv", component="fv", quote_timeout_s=10.0)
        await router.start(("videos", "images"))
        clients = {k: router._clients[k] for k in ("videos", "images")}

        classes = MODES[mode]["classes"]

        async def one(name: str, i: int) -> None:
            kind = classes[name]["kind"]
            if policy == "cost":
                await drain(router.generate(kind, payload(name, i, mode)))
            else:
                request = payload(name, i, mode)
                if kind == "videos":
                    request["stream"] = True  # the same worker protocol as the router's
                await drain(await clients[kind].round_robin(request))

        for i, name in enumerate(classes):  # warm-up: each class once, not measured
            await one(name, 10_000 + i)
        latencies: dict[str, list[float]] = {name: [] for name in classes}
        start = time.monotonic()

        async def timed(at: float, name: str, i: int) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            due = start + at
            await one(name, i)
            latencies[name].append(time.monotonic() - due)

        await asyncio.gather(*(timed(at, name, i) for i, (at, name) in enumerate(plan)))
        latencies["_makespan"] = [time.monotonic() - start]
        if policy == "cost":
            latencies["_fallbacks"] = [float(router.fallbacks)]
        return latencies
    finally:
        await router.close()
        runtime.shutdown()


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(0.95 * len(ordered) + 0.5)) - 1))]


def gpu_sleep_site(site: Path) -> Path:
    """The test-only fv-gpu-sleep plugin, materialised for the workers' PYTHONPATH (never installed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "fv-dynamo" / "tests" / "fixtures"))
    import sleep_site

    return sleep_site.materialise(site)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="wan-tiny",
                        help="wan-tiny: real tiny model on CPU; gpu-sleep: steps sleep their GPU-seconds (one device per worker)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--rate", type=float, default=1.5, help="mean arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="round_robin,cost")
    parser.add_argument("--rounds", type=int, default=3, help="runs per policy, alternating their order")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        import dynamo.runtime  # noqa: F401
    except ImportError:
        print("skip: NVIDIA Dynamo is not installed (plugins/fv-dynamo/README.md: Install)")
        return 0
    from fv_dynamo.local_fleet import LocalFleet, loopback_env

    plan = schedule(args.requests, args.rate, args.seed)
    classes = MODES[args.mode]["classes"]
    counts = {name: sum(1 for _, n in plan if n == name) for name in classes}
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.machine()}, python {platform.python_version()})",
        "command": "python bench/bench_fleet_routing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "mode": args.mode, "requests": counts, "rate_per_s": args.rate, "seed": args.seed, "policies": {},
    }
    policies = args.policies.split(",")
    pooled: dict[str, dict[str, list[float]]] = {p: {name: [] for name in classes} for p in policies}
    makespans: dict[str, list[float]] = {p: [] for p in policies}
    per_round: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    fallbacks = 0
    for round_index in range(args.rounds):
        # Alternate the order every round: a shared machine's load drifts, and neither policy should always go first.
        order = policies if round_index % 2 == 0 else list(reversed(policies))
        for policy in order:
            with tempfile.TemporaryDirectory(prefix="fv-bench-fleet-") as tmp:
                deploy = Path(tmp) / "deploy.yaml"
                deploy.write_text(f"cards: [{MODES[args.mode]['model']}]\n")
                env = {"OMP_NUM_THREADS": "1"}
                if args.mode == "gpu-sleep":
                    env["PYTHONPATH"] = str(gpu_sleep_site(Path(tmp) / "site"))
                fleet = LocalFleet(Path(tmp) / "fleet", deploy, workers=2, frontend=False, extra_env=env)
                try:
                    fleet.start()
                    os.environ.update(loopback_env(fleet.store))
                    latencies = asyncio.run(run_policy(policy, plan, fleet.store, args.mode))
                finally:
                    fleet.stop()
            fallbacks += int(latencies.pop("_fallbacks", [0.0])[0])
            makespans[policy].append(round(latencies.pop("_makespan")[0], 3))
            for name, values in latencies.items():
                pooled[policy][name].extend(values)
            per_round[policy].append({name: round(p95(v), 3) for name, v in latencies.items() if v})
            print(f"round {round_index} {policy} makespan {makespans[policy][-1]}", json.dumps(per_round[policy][-1]), flush=True)
    for policy in policies:
        results["policies"][policy] = {
            name: {"n": len(v), "p50_s": round(statistics.median(v), 3), "p95_s": round(p95(v), 3),
                   "p95_s_per_round": [r.get(name) for r in per_round[policy]]}
            for name, v in pooled[policy].items() if v
        }
        results["policies"][policy]["makespan_s_per_round"] = makespans[policy]
    results["rounds"] = args.rounds
    results["cost_router_fallbacks"] = fallbacks
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
