"""Cosmos 3 resumes across processes: the reasoner's K/V lives in the instance's paged pool, so
``Cosmos3ARDecodeLoop.restore`` allocates blocks in the new process and the loop replays the
exact prefill + ar_token steps that wrote them. Negative controls: without restore, or without
the replay, the fresh-process check fails."""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import pytest

from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.loops import ARDecodeState, Cosmos3ARDecodeLoop
from fv_kernel.api import (
    ARParams,
    DiffusionParams,
    Engine,
    LoopContext,
    ModelCard,
    ModelInstance,
    ProgramCheckpoint,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    build_instance,
    run_local,
)
from fv_kernel.testing import ResumeConformance
from fv_kernel.testing.card_kit import assert_artifacts_identical
from fv_kernel.testing.resume_kit import checkpoints_inside_every_loop

CARD = cosmos3_card("cosmos3-tiny")
TEXT = Request(request_id="resume-text", model="cosmos3-tiny", task=TaskType.TEXT_GENERATION,
               inputs=(TextPart(text="name three colours"),), ar=ARParams(max_tokens=8, temperature=0.8, top_k=20, seed=4))
OMNI = Request(request_id="resume-omni", model="cosmos3-tiny", task=TaskType.TEXT_TO_VIDEO,
               inputs=(TextPart(text="a boat at dawn"),), prompt_upsampling=True, diffusion=DiffusionParams(steps=2, seed=1))


class NoRestoreAR(Cosmos3ARDecodeLoop):
    """Forgets the per-process resource: the restored table names blocks this process never allocated."""

    def restore(self, state: ARDecodeState, model: ModelInstance, ctx: LoopContext) -> ARDecodeState:
        return state


class NoReplayAR(Cosmos3ARDecodeLoop):
    """Allocates fresh blocks but does not rebuild their contents: decoding continues against empty K/V."""

    def restore(self, state: ARDecodeState, model: ModelInstance, ctx: LoopContext) -> ARDecodeState:
        restored = super().restore(state, model, ctx)
        if state.finished:
            return restored
        return restored.model_copy(update={
            "prefilled": state.prefilled, "table": restored.table.model_copy(update={"length": state.table.length}),
        })


def _card_with(loop_class: type) -> ModelCard:
    spec = CARD.loops["ar_decode"].model_copy(update={"implementation": f"{__name__}:{loop_class.__name__}"})
    return CARD.model_copy(update={"loops": {**CARD.loops, "ar_decode": spec}})


class _TextOnly(ResumeConformance):
    card_ids = ("cosmos3-tiny",)

    def requests_for(self, card: ModelCard, *, seeds: Sequence[int] = (0,), prefix: str = "") -> list[Request]:
        return [TEXT]


class NoRestoreKit(_TextOnly):
    def load_card(self, model_id: str) -> ModelCard:
        return _card_with(NoRestoreAR)


class NoReplayKit(_TextOnly):
    def load_card(self, model_id: str) -> ModelCard:
        return _card_with(NoReplayAR)


class TestReasonerResume(_TextOnly):
    """The positive control of the two kits below: the real loop resumes mid-decode."""

    def load_card(self, model_id: str) -> ModelCard:
        return CARD


def test_without_restore_the_fresh_process_cannot_find_the_kv_blocks() -> None:
    with pytest.raises(AssertionError, match=r"resumed from 'ar_decode at step \d+' in a fresh process raised:(.|\n)*not allocated"):
        NoRestoreKit().check_cards(["cosmos3-tiny"])


def test_without_the_replay_the_resumed_decode_differs() -> None:
    with pytest.raises(AssertionError, match=r"resumed from 'ar_decode at step \d+' in a fresh process: artifact 0 \(text\)"):
        NoReplayKit().check_cards(["cosmos3-tiny"])


def test_tokenizer_is_bound_by_the_instance_not_by_a_request() -> None:
    instance = build_instance(CARD)
    loop = instance.loop("ar_decode")
    assert loop._tokenizer is instance.component("tokenizer")  # bound when the instance built the loop
    with pytest.raises(RuntimeError, match="not bound to an instance"):
        Cosmos3ARDecodeLoop(CARD.loops["ar_decode"])._text(
            ARDecodeState.model_construct(generated=[5], stop_ids=[])  # type: ignore[call-arg]
        )


def test_engine_resumes_mid_decode_next_to_a_fresh_request_and_returns_every_block() -> None:
    reference, points = checkpoints_inside_every_loop(OMNI, build_instance(CARD))
    mid_decode = ProgramCheckpoint.from_bytes(next(p.data for p in points if p.position.startswith("ar_decode")))
    fresh = OMNI.with_updates(request_id="fresh-omni")
    instance = build_instance(CARD)

    async def go() -> tuple[Any, Any]:
        engine = Engine(SchedulerConfig(batching="exact"))  # bit-identical resume is exact batching's
        engine.add_instance(instance)
        async with engine.running():
            resumed = engine.submit(mid_decode.request, resume_from=mid_decode)
            other = engine.submit(fresh)
            return await resumed.result(), await other.result()

    resumed, other = asyncio.run(go())
    assert resumed.status == other.status == "completed", (resumed.error, other.error)
    assert_artifacts_identical(reference, resumed.artifacts, what="resumed mid-decode through the engine")
    assert_artifacts_identical(reference, other.artifacts, what="the fresh request next to it")
    assert instance.text_kv_pool.used_blocks == 0  # the resumed request's re-allocated blocks went back too
    # And in the same process, on the instance that wrote it (restore frees what the owner still held).
    again = run_local(mid_decode.request, instance, resume_from=mid_decode)
    assert_artifacts_identical(reference, again, what="resumed twice on one instance")
    assert instance.text_kv_pool.used_blocks == 0
