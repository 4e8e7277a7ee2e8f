"""The cost-aware router against Dynamo's round-robin on a mixed load, where routing can matter.

Two real ``fv worker`` processes serve the test-only ``gpu-sleep`` card (tests/fixtures/fv-gpu-sleep,
put on the workers' PYTHONPATH): each step sleeps its declared 0.1 GPU-seconds, and sleeping
releases the CPU, so each worker is a device of its own (wan-tiny's workers share this machine's
cores, which no routing can help). The classes differ 20x in cost: images 0.1, short videos 0.3,
long videos 2.0 GPU-seconds.

The load arrives within about a second, seeded: videos alternate long and short with images
between them. Round-robin counts requests, not their cost, so every long video lands on the
same worker (~8 GPU-seconds there against ~1.5 on the other); the cost router, pricing each one,
spreads them (~4.8 each). The gap (~3 s of a ~8 s makespan) is many times this machine's
noise (tens of ms per request). Negative control: the same router made to fall back to
round-robin for every request fails the same check. On a CI machine shared with other test
envs, a comparison that fails is measured once more (it failed once so in CI, with the cost
router no better than round-robin, and passed on every run alone or under two busy cores);
the second must pass.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import pytest

from fv_dynamo.local_fleet import LocalFleet, loopback_env
from fv_dynamo.router import CostAwareRouter

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import sleep_site  # noqa: E402 - the fixture plugin's materialiser lives beside the tests

pytestmark = pytest.mark.timeout(180)

#: 0.1 s steps (the benchmark's are 0.05 s): few steps per request keep the CPU's part of the
#: latency (the engine's and Dynamo's per-step work) small even on a loaded CI machine.
STEP_SECONDS = 0.1
CLASSES = {  # kind, fv's fields (passthrough)
    "image": ("images", {"steps": 1}),
    "video-short": ("videos", {"frames": 4, "steps": 3}),
    "video-long": ("videos", {"frames": 16, "steps": 20}),
}


def mixed_load(seed: int) -> list[tuple[float, str]]:
    """(arrival second, class): 4 long and 4 short videos alternating, an image after each, ~0.1 s apart (jittered)."""
    rng = random.Random(seed)
    plan, t = [], 0.0
    for video in ("video-long", "video-short") * 4:
        for name in (video, "image"):
            plan.append((t, name))
            t += rng.uniform(0.05, 0.1)
    return plan


def payload(name: str, i: int) -> dict:
    return {"model": "gpu-sleep", "prompt": "a red circle", "extra_args": {"media_passthrough": {**CLASSES[name][1], "seed": i}}}


class RoundRobinOnly(CostAwareRouter):
    """The negative control: no worker ever quotes, so every request takes Dynamo's round-robin fallback."""

    async def _price(self, *args, **kwargs):
        return None


async def replay(router: CostAwareRouter, plan: list[tuple[float, str]], policy: str) -> tuple[float, dict[str, list[float]]]:
    """Send ``plan``; its makespan and each class's latencies (arrival to last chunk)."""
    clients = router._clients
    latencies: dict[str, list[float]] = {name: [] for name in CLASSES}

    async def one(at: float, name: str, i: int) -> None:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        kind = CLASSES[name][0]
        if policy == "round_robin":  # Dynamo's own router, the same worker protocol as the cost router's
            request = {**payload(name, i), **({"stream": True} if kind == "videos" else {})}
            chunks = [item.data() async for item in await clients[kind].round_robin(request)]
        else:
            chunks = [chunk async for chunk in router.generate(kind, payload(name, i))]
        assert chunks and "error" not in chunks[-1], chunks[-1:]
        latencies[name].append(time.monotonic() - (start + at))

    start = time.monotonic()
    await asyncio.gather(*(one(at, name, i) for i, (at, name) in enumerate(plan)))
    return time.monotonic() - start, latencies


def beats(cost: tuple[float, dict[str, list[float]]], rr: tuple[float, dict[str, list[float]]]) -> list[str]:
    """Why ``cost`` does not beat ``rr`` by the margin (empty: it does): makespan and the long videos' worst
    latency (their p95 at n = 4) at most 80% of round-robin's, and no class's p95 over twice round-robin's
    (short videos do pay: they now share a worker with long ones)."""
    failures = []
    if cost[0] > 0.8 * rr[0]:
        failures.append(f"makespan {cost[0]:.2f} s > 0.8 x round-robin's {rr[0]:.2f} s")
    if max(cost[1]["video-long"]) > 0.8 * max(rr[1]["video-long"]):
        failures.append(f"long-video p95 {max(cost[1]['video-long']):.2f} s > 0.8 x {max(rr[1]['video-long']):.2f} s")
    for name in CLASSES:
        if max(cost[1][name]) > 2 * max(rr[1][name]):
            failures.append(f"{name} p95 {max(cost[1][name]):.2f} s > 2 x round-robin's {max(rr[1][name]):.2f} s")
    return failures


def test_cost_router_beats_round_robin_on_a_mixed_load_of_gpu_like_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("cards: [gpu-sleep]\n")
    site = sleep_site.materialise(tmp_path / "site")
    fleet = LocalFleet(tmp_path / "fleet", deploy, workers=2, frontend=False,
                       extra_env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(site), "FV_GPU_SLEEP_STEP_S": str(STEP_SECONDS)})
    plan = mixed_load(seed=18)
    try:
        fleet.start()
        for key, value in loopback_env(fleet.store).items():
            monkeypatch.setenv(key, value)

        async def scenario() -> dict[str, tuple[float, dict[str, list[float]]]]:
            from dynamo.runtime import DistributedRuntime

            runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
            router = CostAwareRouter(runtime, namespace="fv", component="fv", quote_timeout_s=10.0, price_ttl_s=600.0)
            control = RoundRobinOnly(runtime, namespace="fv", component="fv")
            try:
                await router.start(("videos", "images"))
                await control.start(("videos", "images"))
                for i, name in enumerate(CLASSES):  # warm-up (connections, quotes), not measured
                    [chunk async for chunk in router.generate(CLASSES[name][0], payload(name, 1000 + i))]
                # A timing comparison on a shared CI machine: another env's burst can land on one
                # measurement. One fresh re-measurement of both policies is allowed; the second must pass.
                for attempt in range(2):
                    results = {"round_robin": await replay(router, plan, "round_robin")}
                    results["cost"] = await replay(router, plan, "cost")
                    assert all(d.how == "cost" for d in router.decisions) and router.fallbacks == 0, router.decisions
                    if not beats(results["cost"], results["round_robin"]):
                        break
                    print(f"attempt {attempt + 1}: {beats(results['cost'], results['round_robin'])}")
                results["control"] = await replay(control, plan, "cost")
                assert control.fallbacks == len(plan)
                return results
            finally:
                await router.close()
                await control.close()
                runtime.shutdown()

        results = asyncio.run(scenario())
    finally:
        fleet.stop()
    summary = {policy: (round(m, 2), {n: round(max(v), 2) for n, v in lat.items()}) for policy, (m, lat) in results.items()}
    assert not beats(results["cost"], results["round_robin"]), (beats(results["cost"], results["round_robin"]), summary)
    # Negative control: round-robin through the same router code does not pass the same check.
    assert beats(results["control"], results["round_robin"]), summary
    print(summary)
