"""The paged text-KV pool is part of admission (issue 12: "Admission that really reserves").

The issue's case: 13 concurrent text requests on ``cosmos3-tiny`` over a pool sized for
two. Before, two were admitted and the rest failed with ``capacity`` when the decode
loop's ``init`` could not allocate its blocks. Now the engine registers the instance's
pool, the decode loop's estimate reserves its exact blocks, and a request that does not
fit waits: all 13 complete, never more than two in flight. The negative control takes
the blocks out of the reservation and shows the old failure.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.instance import text_pool_config
from fv_cosmos3.loops import Cosmos3ARDecodeLoop
from fv_kernel.api import (
    ARParams,
    CacheContract,
    DiffusionParams,
    Engine,
    ImagePart,
    InstanceOptions,
    Observer,
    Request,
    SchedulerConfig,
    StepRecord,
    TaskType,
    TextPart,
    build_instance,
    resolve_request,
    run_concurrently,
)
from fv_kernel.testing import StepRecorder, assert_estimate_covers_execution

REQUESTS = 13


def _text(i: int, max_tokens: int = 24) -> Request:
    return Request(request_id=f"t{i}", model="cosmos3-tiny", task=TaskType.TEXT_GENERATION,
                   inputs=(TextPart(text="describe a red fox in snow"),), ar=ARParams(max_tokens=max_tokens, seed=i))


def _blocks_per_request() -> int:
    instance = build_instance(cosmos3_card("cosmos3-tiny"))
    request = resolve_request(instance.card, _text(0))
    return instance.loop("ar_decode").estimate(request, instance).pool_blocks["text_kv"]


def _card_with_pool_for(blocks: int):  # type: ignore[no-untyped-def]
    card = cosmos3_card("cosmos3-tiny")
    block_bytes = text_pool_config(card, InstanceOptions()).block_bytes
    caches = {"text_kv": CacheContract(cache_class="paged_kv", key_fields=("request_id",), budget_bytes=blocks * block_bytes)}
    return card.model_copy(update={"caches": caches})


class InFlight(Observer):
    """After every executed step: requests running, pool blocks taken, and blocks held per request."""

    name = "in-flight"

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.running: list[int] = []
        self.used: list[int] = []
        self.held: set[int] = set()

    def on_step(self, record: StepRecord) -> None:
        assert self.engine is not None
        pool = self.engine.instances["cosmos3-tiny"].text_kv_pool  # type: ignore[attr-defined]
        self.running.append(self.engine.running_count())
        self.used.append(pool.used_blocks)
        self.held |= set(pool.owners().values())


def _run_thirteen(blocks: int) -> tuple[list, InFlight, Engine]:  # type: ignore[type-arg]
    instance = build_instance(_card_with_pool_for(2 * blocks))
    assert instance.text_kv_pool.capacity_blocks == 2 * blocks  # type: ignore[attr-defined]
    watch = InFlight()
    engine = watch.engine = Engine(SchedulerConfig(), observers=[watch])
    engine.add_instance(instance)

    async def go() -> list:  # type: ignore[type-arg]
        async with engine.running():
            handles = [engine.submit(_text(i)) for i in range(REQUESTS)]
            return list(await asyncio.gather(*(h.result() for h in handles)))

    return asyncio.run(go()), watch, engine


def test_thirteen_text_requests_over_a_pool_for_two_all_complete_two_at_a_time() -> None:
    blocks = _blocks_per_request()
    results, watch, engine = _run_thirteen(blocks)
    assert [r.status for r in results] == ["completed"] * REQUESTS, [r.error for r in results if r.error]
    assert max(watch.running) == 2, "never more than the two the pool holds, and two did run together"
    assert max(watch.used) == 2 * blocks
    assert watch.held == {blocks}, "each request holds exactly the blocks its estimate reserved"
    assert engine.metrics.rejections.get("admission_pool_blocks", 0) >= 1
    assert engine.admission.pool_blocks_in_use(next(iter(engine.admission.pools))) == 0


def test_negative_control_without_the_pool_in_the_reservation_requests_fail_for_capacity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks = _blocks_per_request()
    original = Cosmos3ARDecodeLoop.estimate

    def blocks_not_reserved(self, request, model):  # type: ignore[no-untyped-def]
        return original(self, request, model).model_copy(update={"pool_blocks": {}})

    monkeypatch.setattr(Cosmos3ARDecodeLoop, "estimate", blocks_not_reserved)
    results, _, _ = _run_thirteen(blocks)
    failed = [r for r in results if r.status == "failed"]
    assert len(failed) == REQUESTS - 2, "the issue's symptom: two admitted and run, the rest fail"
    assert all(r.error is not None and r.error.type == "capacity" for r in failed)


def test_a_request_that_can_never_fit_fails_at_admission_with_a_typed_error() -> None:
    # One sequence may use the whole pool at most, so a request the pool can never hold asks for more
    # context than the reasoner has here: a typed error at admission, before any step runs.
    blocks = _blocks_per_request()
    recorder = StepRecorder()
    engine = Engine(SchedulerConfig(device_thread=False), observers=[recorder])
    engine.add_instance(build_instance(_card_with_pool_for(blocks)))
    [result] = run_concurrently(engine, [_text(0, max_tokens=200)])
    assert result.status == "failed" and result.error is not None
    assert result.error.type == "invalid_request" and result.error.param == "max_tokens"
    assert f"exceeds the reasoner's {blocks * 16}-token context" in result.error.message
    assert recorder.records == []


def _generation(task: TaskType, **fields: object) -> Request:
    inputs: tuple = (TextPart(text="a fox in snow"),)
    if task is TaskType.IMAGE_TO_VIDEO:
        inputs += (ImagePart(image=torch.rand(3, 32, 64, generator=torch.Generator().manual_seed(0))),)
    return Request(model="cosmos3-tiny", task=task, inputs=inputs,
                   diffusion=DiffusionParams(steps=2, seed=3, **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "exact"),
    [
        (_text(0, max_tokens=6), False),  # may stop at EOS before max_tokens
        (_generation(TaskType.TEXT_TO_VIDEO), True),
        (_generation(TaskType.TEXT_TO_VIDEO, guidance=1.0), True),
        (_generation(TaskType.TEXT_TO_IMAGE, frames=1), True),
        (_generation(TaskType.TEXT_TO_VIDEO_AUDIO), True),
        (_generation(TaskType.IMAGE_TO_VIDEO), True),
    ],
    ids=["text", "t2v", "t2v-no-cfg", "t2i", "t2v-sound", "i2v"],
)
def test_each_estimate_prices_the_steps_its_loops_run(request_: Request, exact: bool) -> None:
    engine = Engine(SchedulerConfig(device_thread=False), observers=[StepRecorder()])
    engine.add_instance(build_instance(cosmos3_card("cosmos3-tiny")))
    assert_estimate_covers_execution(engine, request_, exact=exact)
