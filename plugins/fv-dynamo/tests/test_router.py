"""The cost-aware router: its choice rule, and its decisions over two real fv workers through Dynamo's direct routing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fv_dynamo.local_fleet import LocalFleet, loopback_env
from fv_dynamo.requests import FleetRequestError
from fv_dynamo.router import CostAwareRouter, Quote, _Sent, choose_worker, shape_key

pytestmark = pytest.mark.timeout(240)


def test_choice_is_earliest_predicted_finish_not_least_queued() -> None:
    # Worker 1 runs one long video (3 s over 20 steps); worker 2 runs four short ones (0.4 s over 4 steps each).
    # A 4-step image (0.1 s) shares the long video's steps for only 4 of its 20: 0.1 + 3 * 4/20 = 0.7 s,
    # while on worker 2 it waits a step of each short video per step: 0.1 + 4 * 0.4 = 1.7 s, though less is queued there.
    long_video = Quote(1, gpu_seconds=0.1, steps=4, jobs=((3.0, 20.0),))
    short_videos = Quote(2, gpu_seconds=0.1, steps=4, jobs=((0.4, 4.0),) * 4)
    assert short_videos.queued_gpu_seconds < long_video.queued_gpu_seconds
    assert abs(long_video.predicted_finish_s - 0.7) < 1e-9 and abs(short_videos.predicted_finish_s - 1.7) < 1e-9
    assert choose_worker([long_video, short_videos]).instance_id == 1
    assert choose_worker([short_videos, long_video]).instance_id == 1
    # A request that outlasts every job there waits for all of them.
    assert Quote(3, 2.0, 40, ((3.0, 20.0),)).predicted_finish_s == 5.0
    with pytest.raises(ValueError):
        choose_worker([])


def test_work_at_a_worker_is_its_report_plus_what_it_does_not_list_yet() -> None:
    router = CostAwareRouter(runtime=None)
    # Worker 1's report lists the request this router sent it (route id token 1); worker 2's report
    # does not list token 0 yet (in transit, or submitted after the report): the ledger adds it (1/3 done).
    router._reported = {1: (10.0, ((2.0, 8.0),), frozenset({router._route_id(1)})), 2: (10.0, (), frozenset())}
    router._ledger = {2: {0: _Sent(3.0, 6.0, sent_at=9.0, progress=1 / 3)}, 1: {1: _Sent(2.0, 8.0, sent_at=9.0)}}
    assert router.jobs(1) == ((2.0, 8.0),)  # listed by the worker: not counted twice
    (remaining, steps), = router.jobs(2)
    assert abs(remaining - 2.0) < 1e-9 and abs(steps - 4.0) < 1e-9 and abs(router.queued(2) - 2.0) < 1e-9


def test_equal_predictions_go_to_the_worker_idle_longest() -> None:
    idle = [Quote(1, 0.5, 4), Quote(2, 0.5, 4)]
    assert choose_worker(idle, {1: 5.0, 2: 3.0}).instance_id == 2
    assert choose_worker(idle, {1: 3.0, 2: 5.0}).instance_id == 1
    assert choose_worker(idle).instance_id == 1


def test_prices_are_cached_per_shape_not_per_prompt_or_seed() -> None:
    def video(prompt: str, **fields) -> dict:
        return {"model": "wan-tiny", "prompt": prompt, "extra_args": {"media_passthrough": fields}}

    assert shape_key("videos", video("a fox", seed=1, frames=9)) == shape_key("videos", video("a cat", seed=2, frames=9))
    assert shape_key("videos", video("a fox", frames=9)) != shape_key("videos", video("a fox", frames=33))
    assert shape_key("videos", video("a fox", frames=9)) != shape_key("images", video("a fox", frames=9))


def _runtime():
    from dynamo.runtime import DistributedRuntime

    return DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")


async def _drain(stream) -> list[dict]:
    return [chunk async for chunk in stream]


def test_router_over_two_workers_routes_by_predicted_finish_and_reuses_quotes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
                router = CostAwareRouter(runtime, namespace="fv", component="fv", quote_timeout_s=20.0,
                                         price_ttl_s=600.0)
                await router.start(("videos", "images"))
                long_video = {"model": "wan-tiny", "prompt": "a fox",
                              "extra_args": {"media_passthrough": {"frames": 33, "steps": 60, "seed": 1}}}
                stream = router.generate("videos", long_video)
                first = await stream.__anext__()  # acknowledged: counted in that worker's load
                assert first["status"] == "queued"
                busy = router.decisions[-1].instance_id
                # A second one of the same shape would wait for every step of the first there: the other worker.
                second = router.generate("videos", {**long_video, "prompt": "a cat"})
                assert (await second.__anext__())["status"] == "queued"
                assert router.decisions[-1].instance_id not in (None, busy), router.decisions
                videos = asyncio.ensure_future(asyncio.gather(_drain(stream), _drain(second)))
                image = {"model": "wan-tiny", "prompt": "a fox", "extra_args": {"media_passthrough": {"steps": 2}}}
                images = await asyncio.gather(*(_drain(router.generate("images", image)) for _ in range(3)))
                assert all(chunks[-1]["data"][0]["b64_json"] for chunks in images)
                assert all(d.how == "cost" for d in router.decisions), router.decisions
                for chunks in await videos:
                    assert chunks[-1]["status"] == "completed"
                # One quote per worker and shape: the second video and the three images reused theirs.
                assert router.quotes_asked == 2 * 2
                # The ledger is empty again, and so are the workers' reports once polled.
                await asyncio.sleep(3 * router.poll_interval_s)
                assert all(router.queued(i) == 0 for i in (busy, router.decisions[1].instance_id))

                # A refusal comes back as fv serve's body, unrouted.
                with pytest.raises(FleetRequestError) as refused:
                    await _drain(router.generate("videos", {"model": "wan-tiny", "prompt": "x", "size": "100x64"}))
                assert refused.value.body["error"]["param"] == "width"

                # No worker quotes in time: Dynamo's round robin takes the request.
                router.quote_timeout_s = 1e-6
                router._prices.clear()
                chunks = await _drain(router.generate("images", image))
                assert chunks[-1]["data"] and router.fallbacks == 1 and router.decisions[-1].how == "round_robin"
            finally:
                await router.close()
                runtime.shutdown()

        asyncio.run(scenario())
    finally:
        fleet.stop()
