"""Rollouts are ordinary Engine requests: a group of K is a homogeneous batch, the text encoder runs once per group."""

from __future__ import annotations

import asyncio

from fv_kernel.api import Observer, StepRecord
from fv_rl.rollout import RolloutSettings, rollout_group
from rl_helpers import GEOMETRY, engine_for, request, tiny_instance


class _Steps(Observer):
    name = "steps"

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)


SETTINGS = RolloutSettings(steps=3, capture="final", **GEOMETRY)


def _group(stagger: bool, k: int = 4):
    steps = _Steps()
    engine = engine_for(tiny_instance(), observers=[steps])

    async def go():
        async with engine.running():
            return await rollout_group(engine, "wan-tiny", "a red fox", list(range(k)), SETTINGS, stagger=stagger)

    return asyncio.run(go()), steps.records


def test_group_encodes_the_prompt_once_and_batches_the_denoise_steps():
    rollouts, records = _group(stagger=True)
    assert [r.seed for r in rollouts] == [0, 1, 2, 3] and all(r.record.seed == r.seed for r in rollouts)
    encodes = [r for r in records if r.op == "encode_text"]
    assert sum(len(r.request_ids) for r in encodes) == 1  # one row, for the whole group
    denoise = [r for r in records if r.op.startswith("dit_forward")]
    assert max(len(r.request_ids) for r in denoise) == 4  # the K requests ran their steps as one batch
    assert all(r.record.capture == "final" and r.video.shape[0] == GEOMETRY["frames"] for r in rollouts)


def test_negative_control_submitting_the_group_at_once_encodes_every_request():
    _, records = _group(stagger=False)
    encodes = [r for r in records if r.op == "encode_text"]
    assert sum(len(r.request_ids) for r in encodes) == 4


def test_rollouts_run_at_the_declared_priority_next_to_serving_traffic():
    instance = tiny_instance()
    engine = engine_for(instance)

    async def go():
        async with engine.running():
            serving = engine.submit(request(prompt="a blue lake", seed=9))
            group = asyncio.ensure_future(rollout_group(engine, "wan-tiny", "a red fox", [0, 1], SETTINGS))
            result = await serving.result()
            rollouts = await group
            return result, rollouts, [engine.handle(r.request_id)._record.request.priority for r in rollouts]

    result, rollouts, priorities = asyncio.run(go())
    assert result.status == "completed" and len(rollouts) == 2
    assert priorities == ["batch", "batch"]

