"""Kernel API 2.8 (docs/plugins.md): a ``Done`` carries the chunks no plan will (emitted before ``finalize``), a
step of ``repeat`` sub-steps is priced as that many, and ``compute.decode_tokens_per_step`` is validated."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from fv_kernel.api import (
    ComputeOptions,
    Done,
    EmitSpec,
    Loop,
    LoopContext,
    LoopResult,
    LoopSpec,
    LoopState,
    Request,
    ShapeSignature,
    StepCostSpec,
    StepResult,
    TaskType,
    TextPart,
    WorkKind,
    WorkPlan,
)
from fv_kernel.loop.driver import resume
from fv_kernel.runtime.cost import CostKey, CostModel


class _CountState(LoopState):
    left: int = 3


class _Countdown(Loop[_CountState]):
    """Streams one text chunk per step, the chunk of the step before (as a decode loop streams its last token),
    and the last step's chunk in its ``Done``."""

    kind = "ar_decode"
    state_type = _CountState

    def __init__(self, spec: LoopSpec, *, final_emits: bool = True) -> None:
        super().__init__(spec)
        self.final_emits = final_emits
        self.log: list[str] = []

    def init(self, request: Request, model: Any, ctx: LoopContext) -> _CountState:
        return _CountState(request_id=request.request_id, loop_id=self.loop_id, instance_id="i")

    def _pending(self, state: _CountState) -> list[EmitSpec]:
        return [] if state.left == 3 else [EmitSpec(stream="text", modality="text", text=f"t{state.left + 1}")]

    def next(self, state: _CountState) -> WorkPlan | Done:
        if state.left == 0:
            return Done(emits=tuple(self._pending(state)) if self.final_emits else ())
        return WorkPlan(loop_id=self.loop_id, instance_id="i", kind=WorkKind.AR_TOKEN, op="tick",
                        emits=self._pending(state))

    def advance(self, state: _CountState, result: StepResult) -> _CountState:
        return state.model_copy(update={"left": state.left - 1, "step": state.step + 1})

    def finalize(self, state: _CountState) -> LoopResult:
        self.log.append("finalize")
        return LoopResult(loop_id=self.loop_id, outputs={})


def _run(loop: _Countdown) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    request = Request(model="m", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="x"),))

    async def execute(plan: WorkPlan) -> StepResult:
        return StepResult(outputs={})

    def sink(event_type: str, **fields: Any) -> None:
        events.append((event_type, fields))
        if event_type == "media.complete":
            loop.log.append("complete")

    ctx = LoopContext(request=request, executor=execute, emit_event=sink)
    asyncio.run(resume(loop, loop.init(request, None, ctx), ctx))
    return events


def _spec() -> LoopSpec:
    return LoopSpec(loop_id="count", kind="ar_decode", implementation="tests:none")


def test_a_dones_chunks_are_emitted_before_finalize_and_the_stream_closes_after():
    loop = _Countdown(_spec())
    events = _run(loop)
    texts = [fields["text"] for kind, fields in events if kind == "media.chunk"]
    assert texts == ["t3", "t2", "t1"]  # the last step's chunk came with the Done
    assert [fields["index"] for kind, fields in events if kind == "media.chunk"] == [0, 1, 2]
    assert [kind for kind, _ in events if kind.startswith("media.")][-1] == "media.complete"
    assert loop.log == ["finalize", "complete"]
    # Negative control: without the Done's chunks the last step's text is lost.
    assert [f["text"] for k, f in _run(_Countdown(_spec(), final_emits=False)) if k == "media.chunk"] == ["t3", "t2"]


def test_a_done_refuses_a_chunk_that_names_a_step_output():
    with pytest.raises(ValidationError, match="from_output='frames' has no step to read it from"):
        Done(emits=(EmitSpec(stream="video", modality="video", from_output="frames"),))


def test_a_step_of_repeat_sub_steps_is_priced_as_that_many():
    spec = StepCostSpec(unit="tokens", fixed_seconds=0.02, per_unit_seconds=1e-3)
    one = ShapeSignature.of(tokens=1)
    eight = ShapeSignature.of(tokens=1, repeat=8)
    assert one.repeat == 1 and eight.repeat == 8
    assert CostModel.base_seconds(spec, eight, "bf16") == pytest.approx(8 * CostModel.base_seconds(spec, one, "bf16"))
    model = CostModel()
    # A measured chained step calibrates its own key to its own price: 8 sub-steps at the declared speed.
    key = CostKey("i", "ar_token", eight, "fp32")
    model.observe(key, spec, measured_seconds=8 * 0.021)
    assert model.factor(key) == pytest.approx(1.0)


def test_decode_tokens_per_step_is_validated():
    assert ComputeOptions().decode_tokens_per_step == 8
    with pytest.raises(ValidationError, match="decode_tokens_per_step"):
        ComputeOptions(decode_tokens_per_step=0)
    with pytest.raises(ValidationError, match="decode_tokens_per_step"):
        ComputeOptions(decode_tokens_per_step=65)


def test_the_toy_lm_streams_every_token_of_its_answer():
    """The kernel's toy LM (what plugin authors read): its text chunks add up to the answer, the last token's
    included (it comes with the loop's ``Done``)."""
    from fv_kernel.api import ARParams, Engine, SchedulerConfig, build_instance
    from fv_kernel.runtime.blocking import run_blocking
    from fv_kernel.testing.toy import toy_card

    engine = Engine(SchedulerConfig(device_thread=False))
    engine.add_instance(build_instance(toy_card("toy-lm")))
    request = Request(model="toy-lm", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="hello"),),
                      ar=ARParams(max_tokens=12, temperature=0.0, stop_token_ids=()))

    async def go() -> list[Any]:
        async with engine.running():
            handle = engine.submit(request)
            return [event async for event in handle.events()]

    events = run_blocking(go())
    streamed = "".join(e.text for e in events if e.type == "media.chunk" and e.stream == "text")
    answer = next(e.artifact for e in events if e.type == "artifact.ready" and e.artifact.kind == "text")
    assert streamed == answer.text and len(answer.token_ids) == 12
