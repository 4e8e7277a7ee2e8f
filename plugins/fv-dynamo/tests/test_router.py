"""The cost-aware router: its choice rule, and its decisions over two real fv workers through Dynamo's direct routing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fv_dynamo.local_fleet import LocalFleet, loopback_env
from fv_dynamo.requests import FleetRequestError
from fv_dynamo.router import CostAwareRouter, Quote, choose_worker

pytestmark = pytest.mark.timeout(240)


def test_choice_is_least_predicted_finish_not_shortest_queue() -> None:
    # Worker 2 has the shorter queue, but this request costs far more there (its quote): 3.0 + 0.5 < 1.0 + 4.0.
    quotes = [Quote(1, gpu_seconds=0.5, queued_gpu_seconds=3.0), Quote(2, gpu_seconds=4.0, queued_gpu_seconds=1.0)]
    assert choose_worker(quotes, {}).instance_id == 1
    assert choose_worker(list(reversed(quotes)), {}).instance_id == 1


def test_requests_in_transit_count_against_their_worker() -> None:
    idle = [Quote(1, gpu_seconds=2.0, queued_gpu_seconds=0.0), Quote(2, gpu_seconds=2.0, queued_gpu_seconds=0.0)]
    first = choose_worker(idle, {})
    # The second request, routed before the first was acknowledged, must not land on the same worker.
    second = choose_worker(idle, {first.instance_id: 2.0})
    assert first.instance_id != second.instance_id
    # A worker quoting a dearer price for the same request (slower or busier calibration) loses.
    assert choose_worker([Quote(1, 3.0, 0.0), Quote(2, 1.0, 1.5)], {}).instance_id == 2
    with pytest.raises(ValueError):
        choose_worker([], {})


def _runtime():
    from dynamo.runtime import DistributedRuntime

    return DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")


async def _drain(stream) -> list[dict]:
    return [chunk async for chunk in stream]


def test_router_sends_small_requests_away_from_a_long_video(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("cards: [wan-tiny]\n")
    fleet = LocalFleet(tmp_path / "fleet", deploy, workers=2, frontend=False, extra_env={"OMP_NUM_THREADS": "1"})
    try:
        fleet.start()
        for key, value in loopback_env(fleet.store).items():
            monkeypatch.setenv(key, value)

        async def scenario() -> None:
            runtime = _runtime()
            try:
                router = CostAwareRouter(runtime, namespace="fv", component="fv", quote_timeout_s=20.0)
                await router.start(("videos", "images"))
                long_video = {"model": "wan-tiny", "prompt": "a fox",
                              "extra_args": {"media_passthrough": {"frames": 33, "steps": 60, "seed": 1}}}
                stream = router.generate("videos", long_video)
                first = await stream.__anext__()  # acknowledged: counted in that worker's load
                assert first["status"] == "queued"
                rest = asyncio.ensure_future(_drain(stream))
                busy = router.decisions[-1].instance_id
                image = {"model": "wan-tiny", "prompt": "a fox", "extra_args": {"media_passthrough": {"steps": 2}}}
                images = await asyncio.gather(*(_drain(router.generate("images", image)) for _ in range(3)))
                assert all(chunks[-1]["data"][0]["b64_json"] for chunks in images)
                image_targets = [d.instance_id for d in router.decisions[1:]]
                # Round robin would put one of three on the busy worker; the cost model puts none there.
                assert busy not in image_targets and all(d.how == "cost" for d in router.decisions), router.decisions
                chunks = await rest
                assert chunks[-1]["status"] == "completed"

                # A refusal comes back as fv serve's body, unrouted.
                with pytest.raises(FleetRequestError) as refused:
                    await _drain(router.generate("videos", {"model": "wan-tiny", "prompt": "x", "size": "100x64"}))
                assert refused.value.body["error"]["param"] == "width"

                # No worker quotes in time: Dynamo's round robin takes the request.
                router.quote_timeout_s = 1e-6
                chunks = await _drain(router.generate("images", image))
                assert chunks[-1]["data"] and router.fallbacks == 1 and router.decisions[-1].how == "round_robin"
            finally:
                runtime.shutdown()

        asyncio.run(scenario())
    finally:
        fleet.stop()
