"""Typed fields that mean something: every public field below is read by code, and this
file shows what it does (and, where a check exists, what happens without it).

``OutputSpec.modalities`` / ``stream_previews``, ``WorkPlan.cancel_scope``, the
``media.init`` / ``media.complete`` events, ``StepRecord.steps``, and the card's
parallelism fields (``LoopSpec.valid_parallel_axes`` / ``causal``,
``ParallelismContract.max_degree``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest
from pydantic import BaseModel, ValidationError

from fv_kernel.model.instance import build_instance
from fv_kernel.card.spec import LoopSpec, ModelCard, ParallelismContract
from fv_kernel.errors import InvalidRequest
from fv_kernel.extend.interceptors import StepInterceptor
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.loop.plan import CancelScope, EmitSpec, WorkPlan
from fv_kernel.request.events import Event
from fv_kernel.request.request import ARParams, DiffusionParams, OutputSpec, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.records import GenerationResult
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.runtime.local import run_local
from fv_kernel.testing import StepRecorder
from fv_kernel.testing.toy import ToyDecodeLoop, ToyDenoiseLoop, toy_card

FRAMES = 3  # toy-dit's default frame count: three decode steps, three video chunks


def engine_for(model_id: str, *, recorder: StepRecorder | None = None, extensions: ExtensionSet | None = None) -> Engine:
    engine = Engine(SchedulerConfig(device_thread=False), observers=[recorder] if recorder else [],
                    extensions=extensions)
    engine.add_instance(build_instance(toy_card(model_id)))
    return engine


def t2v(model: str = "toy-dit", **changes: Any) -> Request:
    return Request(model=model, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),), **changes)


def chat(**changes: Any) -> Request:
    return Request(model="toy-lm", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="hi"),),
                   ar=ARParams(max_tokens=6, temperature=0.8, seed=3), **changes)


def run_with_events(engine: Engine, request: Request,
                    on_submit: Callable[[Engine, str], None] | None = None) -> tuple[GenerationResult, list[Event]]:
    async def go() -> tuple[GenerationResult, list[Event]]:
        async with engine.running():
            handle = engine.submit(request)
            if on_submit is not None:
                on_submit(engine, handle.request_id)
            events = [e async for e in handle.events()]
            return await handle.result(), events

    return asyncio.run(go())


def media(events: list[Event]) -> list[tuple[str, str]]:
    return [(e.type, e.stream) for e in events if e.type.startswith("media.")]  # type: ignore[union-attr]


# -- OutputSpec.modalities --------------------------------------------------------------------------


def test_default_output_returns_everything_the_program_makes() -> None:
    result = engine_for("toy-omni").generate(t2v("toy-omni", prompt_upsampling=True, ar=ARParams(max_tokens=4), diffusion=DiffusionParams(steps=2)))
    assert sorted(a.kind for a in result.artifacts) == ["text", "video"]  # the rewritten prompt, then the video


def test_modalities_return_only_the_kinds_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    request = t2v("toy-omni", prompt_upsampling=True, ar=ARParams(max_tokens=4), diffusion=DiffusionParams(steps=2),
                  output=OutputSpec(modalities=frozenset({"video"})))
    result, events = run_with_events(engine_for("toy-omni"), request)
    assert [a.kind for a in result.artifacts] == ["video"]
    assert [e.artifact.kind for e in events if e.type == "artifact.ready"] == ["video"]  # type: ignore[union-attr]
    # The upsampling still ran (it conditions the video); only its text is not returned.
    assert any(e.type == "progress" and e.loop_id == "upsample" for e in events)  # type: ignore[union-attr]
    # Negative control: without the engine's filter the same request returns the text too.
    monkeypatch.setattr(OutputSpec, "keep", lambda self, artifacts: list(artifacts))
    unfiltered = engine_for("toy-omni").generate(request.with_updates(request_id="unfiltered"))
    assert sorted(a.kind for a in unfiltered.artifacts) == ["text", "video"]


def test_run_local_validates_and_filters_like_the_engine() -> None:
    instance = build_instance(toy_card("toy-omni"))
    request = t2v("toy-omni", prompt_upsampling=True, ar=ARParams(max_tokens=4), diffusion=DiffusionParams(steps=2),
                  output=OutputSpec(modalities=frozenset({"video"})))
    assert [a.kind for a in run_local(request, instance)] == ["video"]
    with pytest.raises(InvalidRequest) as info:
        run_local(t2v("toy-omni", output=OutputSpec(modalities=frozenset({"audio"}))), instance)
    assert info.value.param == "output.modalities"


def test_asking_for_a_modality_the_card_does_not_return_is_a_typed_error() -> None:
    engine = engine_for("toy-dit")
    with pytest.raises(InvalidRequest) as info:
        engine.validate(t2v(output=OutputSpec(modalities=frozenset({"video", "audio"}))))
    assert info.value.param == "output.modalities"
    assert "returns no audio" in str(info.value) and info.value.allowed == ["video"]
    with pytest.raises(InvalidRequest) as info:
        engine_for("toy-lm").validate(chat(output=OutputSpec(modalities=frozenset({"video"}))))
    assert info.value.allowed == ["text"]


def test_modalities_must_be_known_kinds_and_not_empty() -> None:
    with pytest.raises(ValidationError):
        OutputSpec(modalities=frozenset({"smell"}))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="at least one"):
        OutputSpec(modalities=frozenset())


def test_behaviour_capture_is_not_offered_until_it_is_built() -> None:
    with pytest.raises(ValidationError, match="capture_behavior"):
        OutputSpec(capture_behavior=True)  # type: ignore[call-arg]


# -- stream_previews and media.init / media.chunk / media.complete ------------------------------------


def test_previews_are_emitted_only_when_asked_for() -> None:
    _, quiet = run_with_events(engine_for("toy-dit"), t2v())
    assert media(quiet) == [], "a request that did not ask for previews gets no preview stream"
    _, loud = run_with_events(engine_for("toy-dit"), t2v(output=OutputSpec(stream_previews=True)))
    assert media(loud) == [("media.init", "video")] + [("media.chunk", "video")] * FRAMES + [("media.complete", "video")]


def test_video_stream_order_and_init_fields() -> None:
    result, events = run_with_events(engine_for("toy-dit"), t2v(output=OutputSpec(stream_previews=True)))
    types = [e.type for e in events]
    init = next(e for e in events if e.type == "media.init")
    assert init.modality == "video" and init.fps == 8.0 and init.sample_rate is None  # type: ignore[union-attr]
    chunks = [e for e in events if e.type == "media.chunk"]
    assert [c.index for c in chunks] == list(range(FRAMES)) and all(c.preview for c in chunks)  # type: ignore[union-attr]
    assert types.index("media.init") < types.index("media.chunk")
    assert max(i for i, t in enumerate(types) if t == "media.chunk") < types.index("media.complete")
    assert types.index("media.complete") < types.index("artifact.ready") < types.index("request.completed")
    assert result.status == "completed"


def test_text_tokens_stream_without_asking_for_previews() -> None:
    result, events = run_with_events(engine_for("toy-lm"), chat())
    streamed = media(events)
    assert streamed[0] == ("media.init", "text") and streamed[-1] == ("media.complete", "text")
    assert streamed.count(("media.init", "text")) == 1 and streamed.count(("media.complete", "text")) == 1
    chunks = [e for e in events if e.type == "media.chunk"]
    assert chunks and not any(c.preview for c in chunks)  # type: ignore[union-attr]
    assert next(e for e in events if e.type == "media.init").modality == "text"  # type: ignore[union-attr]
    text = result.artifact("text")
    assert text is not None and "".join(c.text for c in chunks).startswith(text.text[:1])  # type: ignore[union-attr]


def test_emit_spec_rates_reach_media_init(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ToyDecodeLoop.next

    def next_with_rate(self: ToyDecodeLoop, state: Any) -> Any:
        plan = original(self, state)
        if isinstance(plan, WorkPlan):
            plan.emits = [e.model_copy(update={"fps": 24.0, "sample_rate": 16000}) for e in plan.emits]
        return plan

    monkeypatch.setattr(ToyDecodeLoop, "next", next_with_rate)
    _, events = run_with_events(engine_for("toy-dit"), t2v(output=OutputSpec(stream_previews=True)))
    init = next(e for e in events if e.type == "media.init")
    assert (init.fps, init.sample_rate) == (24.0, 16000)  # type: ignore[union-attr]
    with pytest.raises(ValidationError):
        EmitSpec(stream="audio", modality="audio", sample_rate=0)


def test_a_cancelled_stream_gets_no_media_complete() -> None:
    def cancel_after_first_chunk(engine: Engine, request_id: str) -> None:
        record = engine._records[request_id]
        emit = record.emit

        def emit_then_cancel(event_type: str, **fields: Any) -> None:
            emit(event_type, **fields)
            if event_type == "media.chunk":
                engine.cancel(request_id, "enough")

        record.emit = emit_then_cancel  # type: ignore[method-assign]

    result, events = run_with_events(engine_for("toy-dit"), t2v(output=OutputSpec(stream_previews=True)),
                                     on_submit=cancel_after_first_chunk)
    assert result.status == "cancelled" and events[-1].type == "request.cancelled"
    assert ("media.init", "video") in media(events) and ("media.complete", "video") not in media(events)


def test_a_failed_stream_gets_no_media_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ToyDecodeLoop.advance

    def fail_on_second_frame(self: ToyDecodeLoop, state: Any, result: Any) -> Any:
        if state.step == 1:
            raise RuntimeError("decoder fell over")
        return original(self, state, result)

    monkeypatch.setattr(ToyDecodeLoop, "advance", fail_on_second_frame)
    result, events = run_with_events(engine_for("toy-dit"), t2v(output=OutputSpec(stream_previews=True)))
    assert result.status == "failed" and events[-1].type == "request.failed"
    assert media(events) == [("media.init", "video"), ("media.chunk", "video")]


# -- WorkPlan.cancel_scope --------------------------------------------------------------------------


def with_scope(monkeypatch: pytest.MonkeyPatch, loop_cls: type, scope: CancelScope) -> None:
    original = loop_cls.next

    def scoped(self: Any, state: Any) -> Any:
        plan = original(self, state)
        return plan.model_copy(update={"cancel_scope": scope}) if isinstance(plan, WorkPlan) else plan

    monkeypatch.setattr(loop_cls, "next", scoped)


def cancel_when_queued(loop_id: str, step_index: int) -> Callable[[Engine, str], None]:
    """Cancel the request right after its step ``step_index`` of ``loop_id`` is queued (before it runs)."""

    def install(engine: Engine, request_id: str) -> None:
        pending = engine.scheduler.pending
        add = pending.add

        def add_then_cancel(unit: Any) -> None:
            add(unit)
            if unit.plan.loop_id == loop_id and unit.plan.step_index == step_index:
                engine.cancel(request_id, "cancelled while queued")

        pending.add = add_then_cancel  # type: ignore[method-assign]

    return install


@pytest.mark.parametrize(("scope", "frames_kept"), [(CancelScope.REQUEST, 1), (CancelScope.NONE, 2)])
def test_cancel_scope_of_a_queued_step(monkeypatch: pytest.MonkeyPatch, scope: CancelScope, frames_kept: int) -> None:
    with_scope(monkeypatch, ToyDecodeLoop, scope)
    recorder = StepRecorder()
    result, events = run_with_events(engine_for("toy-dit", recorder=recorder), t2v(),
                                     on_submit=cancel_when_queued("decode", 1))
    assert result.status == "cancelled"
    decoded = [s for r in recorder.records if r.loop_id == "decode" for s in r.steps]
    # REQUEST: the queued step is dropped. NONE: it runs, and the request stops after it.
    assert decoded == list(range(frames_kept))
    (partial,) = result.artifacts
    assert partial.provenance.partial and partial.frames.shape[0] == frames_kept  # type: ignore[union-attr]


@pytest.mark.parametrize(("scope", "steps_run"), [(CancelScope.REQUEST, [0, 1]), (CancelScope.NONE, [0, 1, 2])])
def test_cancel_scope_of_a_planned_step_not_yet_queued(
    monkeypatch: pytest.MonkeyPatch, scope: CancelScope, steps_run: list[int]
) -> None:
    """Cancelled between planning and queueing (an interceptor cancels inside around_step)."""
    with_scope(monkeypatch, ToyDenoiseLoop, scope)
    holder: dict[str, Engine] = {}

    class CancelAtStep2(StepInterceptor):
        plugin_id = "cancel-at-2"

        def distribution_altering(self, params: BaseModel) -> bool:
            return False

        async def around_step(self, plan, state, params, call_next):  # type: ignore[no-untyped-def]
            if plan.step_index == 2:
                holder["engine"].cancel("scoped", "cancelled mid-step")
            return await call_next(plan)

    request = t2v(request_id="scoped")

    extensions = ExtensionSet.build({"cancel-at-2": {"default_on": True}}, {"cancel-at-2": CancelAtStep2})
    recorder = StepRecorder()
    engine = engine_for("toy-dit", recorder=recorder, extensions=extensions)
    holder["engine"] = engine
    result, _ = run_with_events(engine, request)
    assert result.status == "cancelled"
    assert [s for r in recorder.records if r.loop_id == "denoise" for s in r.steps] == steps_run


def test_unimplemented_cancel_scopes_are_not_offered() -> None:
    assert {s.value for s in CancelScope} == {"request", "none"}


# -- StepRecord.steps ----------------------------------------------------------------------------------


def test_observers_see_each_samples_real_step_index() -> None:
    recorder = StepRecorder()
    engine_for("toy-dit", recorder=recorder).generate(t2v(diffusion=DiffusionParams(steps=4)))
    assert [r.steps for r in recorder.records if r.loop_id == "denoise"] == [(0,), (1,), (2,), (3,)]
    assert [r.steps for r in recorder.records if r.loop_id == "decode"] == [(i,) for i in range(FRAMES)]


# -- parallelism fields --------------------------------------------------------------------------------


def card_data() -> dict[str, Any]:
    return toy_card("toy-dit").model_dump()


def test_unknown_parallel_axis_on_a_loop_is_named() -> None:
    with pytest.raises(ValidationError, match="unknown axes \\['warp'\\]"):
        LoopSpec(loop_id="x", kind="vae_decode", implementation="m:C", valid_parallel_axes=("sp", "warp"))


def test_pp_patch_is_invalid_on_a_causal_loop() -> None:
    with pytest.raises(ValidationError) as info:
        LoopSpec(loop_id="chat", kind="ar_decode", implementation="m:C", causal=True, valid_parallel_axes=("pp_patch",))
    assert "loop 'chat' is causal" in str(info.value) and "pp_patch" in str(info.value)
    # The same axis on a non-causal loop is fine.
    assert LoopSpec(loop_id="d", kind="diffusion_denoise", implementation="m:C", valid_parallel_axes=("pp_patch",))


def test_a_degree_on_an_axis_no_loop_lists_is_refused() -> None:
    data = card_data()
    data["parallelism"] = {"max_degree": {"sp": 2}}
    with pytest.raises(ValidationError, match="no loop lists 'sp'"):
        ModelCard.model_validate(data)


def test_parallel_degrees_above_one_need_an_implementation() -> None:
    data = card_data()
    data["loops"]["denoise"]["valid_parallel_axes"] = ("cfgp", "sp")
    data["parallelism"] = {"max_degree": {"sp": 2}}
    with pytest.raises(ValidationError, match="parallelism.implementation is not set"):
        ModelCard.model_validate(data)
    data["parallelism"] = {"max_degree": {"sp": 2}, "implementation": "some.module:parallel"}
    assert ModelCard.model_validate(data).parallelism.max_degree == {"sp": 2}
    # Degree 1 (a trivial axis) promises nothing the runtime cannot do.
    data["parallelism"] = {"max_degree": {"sp": 1, "cfgp": 1}}
    assert ModelCard.model_validate(data).parallelism == ParallelismContract(max_degree={"sp": 1, "cfgp": 1})


def test_graph_capture_is_not_a_loop_field() -> None:
    # The compute tier (ComputeOptions.cuda_graphs) is the one switch for CUDA graphs.
    with pytest.raises(ValidationError, match="graph_capture"):
        LoopSpec(loop_id="x", kind="vae_decode", implementation="m:C", graph_capture="always")  # type: ignore[call-arg]
