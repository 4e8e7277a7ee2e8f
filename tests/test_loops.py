"""The loop contract on the toy cards: driver, save/resume in another process, shared weights."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from fv_kernel.model.instance import build_instance
from fv_kernel.model.validate import resolve_request
from fv_kernel.loop.contract import LoopContext
from fv_kernel.loop.contract import LoopState
from fv_kernel.loop.plan import StepResult, WorkPlan
from fv_kernel.state import StateFormatError
from fv_kernel.request.events import MediaChunk
from fv_kernel.request.request import ARParams, DiffusionParams, ImagePart, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.local import run_local
from fv_kernel.testing.card_kit import assert_artifacts_identical
from fv_kernel.testing.toy import DenoiseState, toy_card

T2V = Request(request_id="r1", model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),),
              diffusion=DiffusionParams(seed=3, steps=6))
GEN = Request(request_id="r2", model="toy-lm", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="once"),),
              ar=ARParams(max_tokens=8, temperature=0.9, top_k=40, top_p=0.9, presence_penalty=0.5, seed=11))


def test_requests_reject_invalid_combinations() -> None:
    with pytest.raises(ValidationError, match="needs input part"):
        Request(model="m", task=TaskType.IMAGE_TO_VIDEO, inputs=(TextPart(text="x"),))
    with pytest.raises(ValidationError, match="at most one prompt"):
        Request(model="m", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a"), TextPart(text="b")))
    with pytest.raises(ValidationError, match="3 channels"):
        ImagePart(image=torch.rand(4, 8, 8))
    with pytest.raises(ValidationError):
        DiffusionParams(steps=0)
    with pytest.raises(ValidationError, match="exactly one of"):
        MediaChunk(request_id="r", stream="video", index=0, pts=(0, 1), preview=True)
    assert Request(model="m", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="x"),)).ar is not None


def _save_midway(request: Request, model_id: str, loop_id: str, at_step: int, path: Path) -> list:
    """Run ``request``; when loop ``loop_id`` reaches ``at_step``, save its state and upstream to ``path``."""
    instance = build_instance(toy_card(model_id))
    saved = {}

    def on_state(state: LoopState) -> None:
        if state.loop_id == loop_id and state.step == at_step and not saved:
            saved["state"] = state.to_bytes()
            saved["type"] = f"{type(state).__module__}:{type(state).__qualname__}"
        return None

    artifacts = run_local(request, instance, on_state=on_state)
    torch.save({"state": saved["state"], "type": saved["type"]}, path)
    return artifacts


RESUME_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, torch
    from fv_kernel.model.instance import build_instance, import_object
    from fv_kernel.model.validate import resolve_request
    from fv_kernel.loop.contract import LoopContext
    from fv_kernel.loop.contract import StepResult
    from fv_kernel.loop.driver import resume
    from fv_kernel.runtime.local import run_local
    from fv_kernel.testing.toy import toy_card

    path, model_id, loop_id, request_json, out = sys.argv[1:6]
    from fv_kernel.request.request import Request
    request = resolve_request(toy_card(model_id), Request.model_validate_json(request_json))
    blob = torch.load(path, weights_only=True)
    state_cls = import_object(blob["type"])
    state = state_cls.from_bytes(blob["state"])
    instance = build_instance(toy_card(model_id))
    instance.load_for_task(request.task)

    async def execute(plan):
        return StepResult(outputs=instance.op(plan.op).fn(plan.inputs, plan.params))

    result = asyncio.run(resume(instance.loop(loop_id), state, LoopContext(request=request, executor=execute)))
    torch.save({"latents": result.outputs.get("latents"),
                "token_ids": result.artifacts[0].token_ids if result.artifacts else None}, out)
    """
)


@pytest.mark.parametrize(
    ("request_", "model_id", "loop_id", "at_step", "key"),
    [(T2V, "toy-dit", "denoise", 3, "latents"), (GEN, "toy-lm", "decode_text", 4, "token_ids")],
    ids=["diffusion_denoise", "ar_decode"],
)
def test_loop_state_saved_in_one_process_resumes_bit_identically_in_another(tmp_path: Path, request_, model_id, loop_id, at_step, key) -> None:
    state_file, out_file = tmp_path / "state.pt", tmp_path / "out.pt"
    _save_midway(request_, model_id, loop_id, at_step, state_file)
    # The reference: the same loop run uninterrupted in this process.
    instance = build_instance(toy_card(model_id))
    finals = {}

    def capture(state: LoopState) -> None:
        if state.loop_id == loop_id:
            finals["state"] = state
        return None

    run_local(request_, instance, on_state=capture)
    subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, str(state_file), model_id, loop_id, request_.model_dump_json(), str(out_file)],
        check=True, capture_output=True, text=True, timeout=120,
    )
    resumed = torch.load(out_file, weights_only=True)
    reference = instance.loop(loop_id).finalize(finals["state"])
    if key == "latents":
        assert torch.equal(resumed["latents"], reference.outputs["latents"])
    else:
        assert resumed["token_ids"] == reference.artifacts[0].token_ids


def test_state_of_one_type_cannot_load_as_another() -> None:
    state = LoopState(request_id="r", loop_id="l", instance_id="i")
    with pytest.raises(StateFormatError, match="cannot load it as"):
        DenoiseState.from_bytes(state.to_bytes())
    with pytest.raises(StateFormatError):
        LoopState.from_bytes(torch.zeros(1).numpy().tobytes())


def test_one_instance_runs_ar_and_diffusion_loops_in_one_request_on_shared_weights() -> None:
    instance = build_instance(toy_card("toy-omni"))
    request = Request(model="toy-omni", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="cat"),),
                      prompt_upsampling=True, ar=ARParams(max_tokens=5, seed=1), diffusion=DiffusionParams(seed=2))
    calls: list[str] = []
    lm = instance.component("lm")
    hook = lm.register_forward_hook(lambda *a: None)
    hook.remove()
    original_ops = dict(instance.ops)

    artifacts = run_local(request, instance, on_event=lambda t, **k: calls.append(t))
    kinds = sorted(a.kind for a in artifacts)
    assert kinds == ["text", "video"]
    assert set(instance.components) == {"lm", "dit", "decoder"}
    # The same LM module object serves the decode loop and the diffusion loop's text encoding.
    assert instance.component("lm") is lm
    assert {"lm_prefill", "lm_decode", "encode_text", "dit_forward", "decode_frame"} <= set(original_ops) | set(instance.ops)
    # The upsampled prompt actually conditioned the video: same seed without upsampling differs.
    plain = run_local(request.with_updates(prompt_upsampling=False), instance)
    video_up = next(a for a in artifacts if a.kind == "video")
    video_plain = next(a for a in plain if a.kind == "video")
    assert not torch.equal(video_up.frames, video_plain.frames)


def test_custom_executor_sees_every_step_once_and_next_describes_work() -> None:
    instance = build_instance(toy_card("toy-dit"))
    request = resolve_request(instance.card, T2V)
    instance.load_for_task(request.task)
    seen: list[WorkPlan] = []

    async def execute(plan: WorkPlan) -> StepResult:
        seen.append(plan)
        return StepResult(outputs=instance.op(plan.op).fn(plan.inputs, plan.params))

    async def go():
        ctx = LoopContext(request=request, executor=execute)
        return await instance.program(request.task).run(instance, ctx)

    artifacts = asyncio.run(go())
    kinds = [p.kind.value for p in seen]
    assert kinds == ["encoder_chunk"] + ["diffusion_step"] * 6 + ["vae_tile"] * 3
    assert all(p.instance_id == instance.instance_id for p in seen)
    assert seen[1].inputs["x"].shape[0] == 2, "CFG batched as two branches of one step"
    assert artifacts[0].frames.shape == (3, 3, 8, 8)


def test_loop_state_resume_from_bytes_matches_uninterrupted_run() -> None:
    instance = build_instance(toy_card("toy-dit"))
    plain = run_local(T2V, instance)
    resumed = run_local(T2V, instance, on_state=lambda s: type(s).from_bytes(s.to_bytes()))
    assert_artifacts_identical(plain, resumed)

