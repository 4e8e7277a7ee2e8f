"""Resume points: states refuse unserializable values when written, program checkpoints
round-trip and continue a request bit-identically, and unusable checkpoints fail typed."""

from __future__ import annotations

import asyncio
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict

import fv_kernel.state as state_module
from fv_kernel.model.instance import build_instance
from fv_kernel.errors import FvError
from fv_kernel.loop.contract import LoopState
from fv_kernel.state import StateFormatError, StateNotSerializable, TensorState
from fv_kernel.program.resume import (
    CheckpointIncompatible,
    ProgramCheckpoint,
    ProgramNotResumable,
    ProgramRun,
)
from fv_kernel.request.request import ARParams, DiffusionParams, ImagePart, OutputSpec, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.runtime.local import run_local
from fv_kernel.testing.card_kit import assert_artifacts_identical
from fv_kernel.testing.toy import DenoiseState, ToyDenoiseLoop, toy_card
from resume_programs import DrivesItsLoopsItself

T2V = Request(request_id="resume-t2v", model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),),
              diffusion=DiffusionParams(seed=3, steps=5))
OMNI = Request(request_id="resume-omni", model="toy-omni", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="cat"),),
               prompt_upsampling=True, ar=ARParams(max_tokens=5, temperature=0.9, top_k=20, seed=1),
               diffusion=DiffusionParams(seed=2, steps=3))


# One intra-op thread in this process and in the fresh ones it starts (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _state_with(value: Any) -> LoopState:
    return LoopState(request_id="r", loop_id="denoise", instance_id="i", plugin_state={"x": {"cond": value}})


# --------------------------------------------------------------------------- write-time check


@pytest.mark.parametrize(
    ("value", "type_name"),
    [(torch.Generator(), "torch.Generator"), (lambda: 1, "function"), (torch.nn.Linear(1, 1), "torch.Linear"),
     ((i for i in range(2)), "generator"), (object(), "object")],
    ids=["rng", "lambda", "module", "generator", "object"],
)
def test_unserializable_value_fails_when_written_naming_state_loop_and_field(value: Any, type_name: str, tmp_path: Path) -> None:
    state = _state_with(value)
    with pytest.raises(StateNotSerializable) as info:
        state.to_bytes()
    message = str(info.value)
    assert message.startswith(f"LoopState.plugin_state['x']['cond'] (loop 'denoise'): {type_name} is not serializable"), message
    assert info.value.param == "plugin_state['x']['cond']"
    assert isinstance(info.value, FvError) and info.value.info()["type"] == "state_not_serializable"
    with pytest.raises(StateNotSerializable):
        state.save(tmp_path / "state.pt")
    assert not (tmp_path / "state.pt").exists(), "save() must refuse before it opens the file"


def test_without_the_write_check_the_same_state_fails_only_on_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: what the check prevents. With it switched off, writing a Generator
    'works' and reading it back is an opaque format error far from the bug."""
    original = state_module._to_plain
    monkeypatch.setattr(state_module, "_to_plain", lambda value, **kw: original(value, **{**kw, "strict": False}))
    data = _state_with(torch.Generator()).to_bytes()
    with pytest.raises(StateFormatError, match="not a readable fv state"):
        LoopState.from_bytes(data)


def test_nested_field_paths_and_dict_keys_are_named() -> None:
    class Inner(TensorState):
        items: list[Any]

    class Outer(LoopState):
        inner: Inner

    state = Outer(request_id="r", loop_id="upsample", instance_id="i", inner=Inner(items=[torch.zeros(1), torch.Generator()]))
    with pytest.raises(StateNotSerializable, match=r"^Outer\.inner\.items\[1\] \(loop 'upsample'\): torch\.Generator"):
        state.to_bytes()
    with pytest.raises(StateNotSerializable, match=r"plugin_state\['x'\]\['c'\] key <object"):
        LoopState(request_id="r", loop_id="l", instance_id="i", plugin_state={"x": {"c": {object(): 1}}}).to_bytes()


class _Color(str, Enum):
    RED = "red"


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Typed(TensorState):
    color: _Color
    tags: frozenset[str]
    pair: tuple[int, int]
    request: Request
    loose: _Loose


def test_enums_sets_tuples_and_requests_with_tensors_round_trip_with_weights_only() -> None:
    image = torch.rand(3, 8, 8)
    request = Request(model="toy-dit", task=TaskType.IMAGE_TO_VIDEO, inputs=(TextPart(text="x"), ImagePart(image=image)),
                      output=OutputSpec(modalities=frozenset({"video", "text"})))
    value = _Typed(color=_Color.RED, tags=frozenset({"a", "b"}), pair=(1, 2), request=request, loose=_Loose(extra=3))
    back = _Typed.from_bytes(value.to_bytes())
    assert back.loose.model_extra == {"extra": 3}
    assert back.color is _Color.RED and back.tags == frozenset({"a", "b"}) and back.pair == (1, 2)
    assert back.request.task is TaskType.IMAGE_TO_VIDEO and back.request.output.modalities == frozenset({"video", "text"})
    assert torch.equal(back.request.part("image").image, image)


def test_state_bytes_of_the_wrong_layout_are_a_typed_format_error() -> None:
    # A DenoiseState of an older layout: the base fields only.
    payload = {**LoopState(request_id="r", loop_id="l", instance_id="i").to_payload(), "type": "fv_kernel.testing.toy:DenoiseState"}
    with pytest.raises(StateFormatError, match="DenoiseState data does not fit its fields: latents: Field required"):
        DenoiseState.from_payload(payload)


# --------------------------------------------------------------------------- program checkpoints


def _checkpoints(request: Request, model_id: str) -> tuple[list[Any], list[bytes]]:
    instance = build_instance(toy_card(model_id))
    saved: list[bytes] = []
    artifacts = run_local(request, instance, on_step=lambda run: saved.append(run.checkpoint().to_bytes()))
    return artifacts, saved


@pytest.mark.parametrize(("request_", "model_id"), [(T2V, "toy-dit"), (OMNI, "toy-omni")], ids=["inline", "custom-program"])
def test_every_step_boundary_resumes_bit_identically_on_a_fresh_instance(request_: Request, model_id: str) -> None:
    reference, saved = _checkpoints(request_, model_id)
    positions = []
    for data in saved:
        checkpoint = ProgramCheckpoint.from_bytes(data)
        positions.append(checkpoint.position())
        resumed = run_local(checkpoint.request, build_instance(toy_card(model_id)), resume_from=checkpoint)
        assert_artifacts_identical(reference, resumed, what=f"{model_id} resumed {checkpoint.position()}")
    loops = {"toy-dit": ["text_encode", "denoise", "decode"], "toy-omni": ["upsample", "text_encode", "denoise", "decode"]}
    assert all(any(p.startswith(f"{loop} at step") for p in positions) for loop in loops[model_id]), positions


def test_checkpoint_records_request_finished_loops_and_running_state() -> None:
    _, saved = _checkpoints(OMNI, "toy-omni")
    checkpoint = next(c for c in map(ProgramCheckpoint.from_bytes, saved) if c.running and c.running[0].loop_id == "denoise")
    assert [f.key for f in checkpoint.finished] == ["upsample", "text_encode"]
    assert checkpoint.upstream["upsampled_prompt"] == checkpoint.finished[0].outputs["text"]
    assert [a.kind for a in checkpoint.artifacts] == ["text"]
    assert checkpoint.request.request_id == OMNI.request_id and checkpoint.started
    assert checkpoint.program == "fv_kernel.testing.toy:UpsampleThenGenerate"
    state = DenoiseState.from_payload(checkpoint.running[0].state)
    assert state.step == checkpoint.running[0].step >= 1


def test_a_resumed_loop_continues_from_its_state_and_earlier_loops_are_not_run_again() -> None:
    _, saved = _checkpoints(T2V, "toy-dit")
    checkpoint = next(c for c in map(ProgramCheckpoint.from_bytes, saved) if c.running and c.running[0].step == 3
                      and c.running[0].loop_id == "denoise")
    instance = build_instance(toy_card("toy-dit"))
    ran: list[tuple[str, int | None]] = []
    inits: list[str] = []
    original_init = ToyDenoiseLoop.init

    async def run() -> None:
        from fv_kernel.runtime.local import run_local_async

        def on_event(kind: str, **fields: Any) -> None:
            if kind == "progress":
                ran.append((fields["loop_id"], fields["step"]))

        loop = instance.loop("denoise")
        loop.init = lambda *a, **k: inits.append("denoise") or original_init(loop, *a, **k)  # type: ignore[method-assign]
        await run_local_async(checkpoint.request, instance, resume_from=checkpoint, on_event=on_event)

    asyncio.run(run())
    assert inits == [], "a resumed loop is restored, never re-initialised"
    assert [s for l, s in ran if l == "text_encode"] == [], "a finished loop is replayed from its recorded result"
    assert [s for l, s in ran if l == "denoise"] == [4, 5]


def test_unusable_checkpoints_fail_typed_before_running() -> None:
    _, saved = _checkpoints(T2V, "toy-dit")
    checkpoint = ProgramCheckpoint.from_bytes(saved[3])
    instance = build_instance(toy_card("toy-dit"))
    program = instance.program(TaskType.TEXT_TO_VIDEO)

    def open_(cp: ProgramCheckpoint, request: Request | None = None) -> None:
        ProgramRun(program, instance, request or cp.request, resume_from=cp)

    with pytest.raises(CheckpointIncompatible, match="weights") as info:
        open_(checkpoint.model_copy(update={"weights_version": "other"}))
    assert info.value.param == "weights_version"
    with pytest.raises(CheckpointIncompatible, match="card 'toy-lm'"):
        open_(checkpoint.model_copy(update={"model_id": "toy-lm"}))
    with pytest.raises(CheckpointIncompatible, match="program"):
        open_(checkpoint.model_copy(update={"program": "elsewhere:Other"}))
    with pytest.raises(CheckpointIncompatible, match="cannot resume request 'other'"):
        open_(checkpoint, checkpoint.request.with_updates(request_id="other"))
    with pytest.raises(CheckpointIncompatible, match="request differs"):
        open_(checkpoint, checkpoint.request.with_updates(diffusion=DiffusionParams(seed=4, steps=5)))
    bad_state = checkpoint.running[0].model_copy(update={"state": {**checkpoint.running[0].state, "state_version": 99}})
    with pytest.raises(CheckpointIncompatible, match="state_version 99"):
        open_(checkpoint.model_copy(update={"running": [bad_state]}))
    with pytest.raises(StateFormatError, match="not a readable fv state"):
        ProgramCheckpoint.from_bytes(b"garbage")


def test_a_program_that_is_not_resumable_refuses_a_started_checkpoint_but_runs_an_unstarted_one() -> None:
    instance = build_instance(toy_card("toy-dit"))
    request = T2V.with_updates(request_id="custom")
    program = DrivesItsLoopsItself(instance.card)
    fresh = ProgramCheckpoint.for_request(program, instance, request)
    assert not fresh.started
    ProgramRun(program, instance, request, resume_from=fresh)  # nothing ran: it may start over
    started = fresh.model_copy(update={"finished": ProgramCheckpoint.from_bytes(_checkpoints(T2V, "toy-dit")[1][2]).finished})
    with pytest.raises(ProgramNotResumable, match="does not support resuming a started request"):
        ProgramRun(program, instance, request, resume_from=started)


def test_unserializable_loop_state_fails_the_checkpoint_write_naming_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ToyDenoiseLoop.advance

    def leaky(self: ToyDenoiseLoop, state: DenoiseState, result: Any) -> DenoiseState:
        new = original(self, state, result)
        return new.model_copy(update={"plugin_state": {"x": {"cond": torch.Generator()}}})

    monkeypatch.setattr(ToyDenoiseLoop, "advance", leaky)
    instance = build_instance(toy_card("toy-dit"))
    with pytest.raises(StateNotSerializable, match=r"DenoiseState\.plugin_state\['x'\]\['cond'\] \(loop 'denoise'\)"):
        run_local(T2V, instance, on_step=lambda run: run.checkpoint())


# --------------------------------------------------------------------------- the engine


def test_engine_submit_resumes_a_checkpoint_and_reports_checkpoints_per_step() -> None:
    reference, saved = _checkpoints(T2V, "toy-dit")
    checkpoint = ProgramCheckpoint.from_bytes(saved[2])
    steps: list[int] = []

    async def go() -> tuple[Any, Any]:
        engine = Engine(SchedulerConfig())
        engine.add_instance(build_instance(toy_card("toy-dit")))
        async with engine.running():
            resumed = await engine.submit(checkpoint.request, resume_from=checkpoint).result()
            fresh = await engine.submit(T2V.with_updates(request_id="again"), on_step=lambda run: steps.append(run.steps)).result()
            with pytest.raises(CheckpointIncompatible):
                engine.submit(checkpoint.request.with_updates(request_id="x"), resume_from=checkpoint)
        return resumed, fresh

    resumed, fresh = asyncio.run(go())
    assert resumed.status == "completed", resumed.error
    assert_artifacts_identical(reference, resumed.artifacts, what="engine resume")
    assert fresh.status == "completed" and steps == list(range(1, len(saved) + 1))


# --------------------------------------------------------------------------- the docs' example


def test_the_cards_doc_resume_example_runs() -> None:
    import contextlib
    import io
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / "cards.md").read_text()
    (block,) = re.findall(r"<!-- doc-test: tests/test_resume.py[^>]*-->\n```python\n(.*?)```", doc, flags=re.S)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "docs/cards.md", "exec"), {})
    expected = re.search(r"print\(checkpoint.position\(\)\)  # (.*)", block)
    assert expected is not None and printed.getvalue().strip() == expected.group(1)
