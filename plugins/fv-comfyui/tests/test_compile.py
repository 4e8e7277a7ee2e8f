"""API prompt → fv jobs: what each fixture compiles to, the model mapping, and the A14B expert switch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import load_pair, retarget
from fv_comfyui.models import ComfyModelsError, ModelMap, ModelTarget


def test_t2v_compiles_to_one_request_on_wan_tiny(service: Any) -> None:
    answer = service.check(retarget(load_pair("text_to_video_wan")[1]))
    (job,) = answer.jobs
    assert job.card.model_id == "wan-tiny" and job.image_name is None
    assert job.prompt.startswith("a fox moving quickly")
    assert job.options == {
        "height": 32, "width": 32, "frames": 5, "steps": 3, "guidance": 6.0, "shift": 8.0,
        "sampler": "comfy-uni_pc-simple", "seed": 82628696717253, "negative_prompt": load_pair("text_to_video_wan")[1]["7"]["inputs"]["text"],
    }
    assert [(t.node_id, t.format, t.fps, t.filename_prefix) for t in job.outputs] == [("28", "webp", 16.0, "ComfyUI")]
    assert job.nodes.index("37") < job.nodes.index("48") < job.nodes.index("3") < job.nodes.index("8") < job.nodes.index("28")
    assert job.request().task.value == "text_to_video"


def test_i2v_compiles_with_its_image(service: Any) -> None:
    (job,) = service.check(retarget(load_pair("image_to_video_wan_example")[1])).jobs
    assert job.card.model_id == "wan-tiny-i2v" and job.image_name == "flux_dev_example.png"
    assert job.task.value == "image_to_video"


def test_a14b_two_stages_become_one_run_switching_experts_at_the_workflows_step(service: Any) -> None:
    prompt = retarget(load_pair("text_to_video_wan22_14B")[1], steps=5)  # 6 steps, switch at 2
    (job,) = service.check(prompt).jobs
    assert job.card is service.cards["wan-tiny-a14b"]  # the installed card, as it is
    assert job.options["guidance"] == 3.5 and job.options["guidance_2"] == 3.5 and job.options["switch_step"] == 2
    request = job.request()
    assert (request.diffusion.switch_step, request.diffusion.guidance_2) == (2, 3.5)
    assert [(t.node_id, t.format) for t in job.outputs] == [("28", "webp"), ("47", "webm")]
    args = job.fv_generate_args("wan-tiny-a14b")  # what `fv generate` runs the same request with
    assert args[args.index("--guidance"):args.index("--shift")] == [
        "--guidance", "3.5", "--guidance-2", "3.5", "--switch-step", "2"]


@pytest.mark.parametrize(("node", "field", "value", "why"), [
    ("57", "return_with_leftover_noise", "disable", "leftover noise"),
    ("57", "end_at_step", 3, "must end where the second starts"),
    ("58", "sampler_name", "euler", None),  # same as stage 1: fine
    ("58", "scheduler", "normal", "same scheduler"),
    ("58", "steps", 7, "same steps"),
    ("58", "add_noise", "enable", "second stage of a two-stage chain"),
    ("55", "shift", 5.0, "different schedules"),
])
def test_two_stage_chains_fv_cannot_express_are_refused(service: Any, node: str, field: str, value: Any, why: str | None) -> None:
    prompt = retarget(load_pair("text_to_video_wan22_14B")[1])
    prompt[node]["inputs"][field] = value
    answer = service.check(prompt)
    if why is None:
        assert answer.ok
        return
    assert not answer.ok and answer.error["type"] == "prompt_outputs_failed_validation"
    (entry,) = answer.node_errors.values()
    assert entry["errors"][0]["type"] == "custom_validation_failed" and why in entry["errors"][0]["details"]
    assert entry["dependent_outputs"] == ["28", "47"]


def test_a14b_experts_must_be_mapped_to_their_components(service: Any) -> None:
    prompt = retarget(load_pair("text_to_video_wan22_14B")[1])
    prompt["37"]["inputs"]["unet_name"], prompt["56"]["inputs"]["unet_name"] = (
        prompt["56"]["inputs"]["unet_name"], prompt["37"]["inputs"]["unet_name"])  # high and low swapped
    answer = service.check(prompt)
    assert not answer.ok and "transformer_2" in answer.node_errors["58"]["errors"][0]["details"]


def test_fv_generate_args() -> None:
    from fv_comfyui.compile import ComfyJob

    job = ComfyJob(card=None, prompt="a fox", options={"steps": 3, "seed": 7, "negative_prompt": "blur"},  # type: ignore[arg-type]
                   image_name=None, outputs=[], nodes=[], sampler_node="3")
    assert job.fv_generate_args("wan-tiny", "in.png") == [
        "--model", "wan-tiny", "--prompt", "a fox", "--negative-prompt", "blur", "--steps", "3", "--seed", "7", "--image", "in.png"]


def test_model_map_file(tmp_path: Path) -> None:
    mapping = ModelMap.from_data({"a.safetensors": "wan-tiny", "b.safetensors": ["wan-tiny", "wan-tiny-a14b:transformer_2"]})
    assert mapping.targets("b.safetensors") == (ModelTarget("wan-tiny"), ModelTarget("wan-tiny-a14b", "transformer_2"))
    assert mapping.folders()["diffusion_models"] == ["a.safetensors", "b.safetensors"]
    for bad, message in [("[1, 2]", "expected a mapping"), ("a.safetensors: 'has space'", "is not a card id"),
                         ("a.safetensors: []", "an empty list"), ("a: [b", "not valid YAML")]:
        path = tmp_path / "m.yaml"
        path.write_text(bad)
        with pytest.raises(ComfyModelsError, match=message):
            ModelMap.from_yaml(path)
    with pytest.raises(ComfyModelsError, match="cannot read it"):
        ModelMap.from_yaml(tmp_path / "absent.yaml")
    with pytest.raises(ComfyModelsError, match="maps to card 'nope', which is not installed"):
        ModelMap.from_data({"a": "nope"}).check_cards({"wan-tiny"})


def test_create_video_and_save_video_write_an_mp4(service: Any) -> None:
    prompt = retarget(load_pair("text_to_video_wan")[1])
    prompt["90"] = {"class_type": "CreateVideo", "inputs": {"images": ["8", 0], "fps": 12.0}}
    prompt["91"] = {"class_type": "SaveVideo", "inputs": {"video": ["90", 0], "filename_prefix": "video/fv",
                                                          "format": "auto", "codec": "auto"}}
    answer = service.check(prompt)
    (job,) = answer.jobs  # both outputs read VAEDecode 8: one request
    assert [(t.node_id, t.format, t.fps, t.filename_prefix) for t in job.outputs] == [
        ("28", "webp", 16.0, "ComfyUI"), ("91", "mp4", 12.0, "video/fv")]
    prompt["92"] = {"class_type": "VAELoader", "inputs": {"vae_name": "wan_2.1_vae.safetensors"}}
    prompt["90"]["inputs"]["audio"] = ["92", 0]  # a VAE is no AUDIO: ComfyUI's type check answers first
    assert answer.ok and service.check(prompt).node_errors["90"]["errors"][0]["type"] == "return_type_mismatch"


def test_audio_into_create_video_is_refused(service: Any) -> None:
    from dataclasses import replace

    from fv_comfyui.nodes import NODE_SPECS, NodeSpec

    prompt = retarget(load_pair("text_to_video_wan")[1])
    prompt["90"] = {"class_type": "CreateVideo", "inputs": {"images": ["8", 0], "fps": 12.0, "audio": ["93", 0]}}
    prompt["91"] = {"class_type": "SaveVideo", "inputs": {"video": ["90", 0], "filename_prefix": "v", "format": "auto",
                                                          "codec": "auto"}}
    prompt["93"] = {"class_type": "LoadAudio", "inputs": {}}
    # fv covers no audio node, so a real prompt stops at missing_node_type; the compiler's own refusal
    # is reached with a stand-in AUDIO source.
    specs = {**NODE_SPECS, "LoadAudio": NodeSpec("LoadAudio", "LoadAudio", (), ("AUDIO",), ("AUDIO",), "audio")}
    assert service.check(prompt).error["type"] == "missing_node_type"
    from fv_comfyui.compile import compile_prompt
    from fv_comfyui.validate import validate_prompt

    context = replace(service.validation_context(), specs=specs)
    result = validate_prompt(prompt, context)
    compiled = compile_prompt(prompt, result.good_outputs, models=service.models, cards=service.cards)
    assert "make no sound" in compiled.node_errors["90"]["errors"][0]["details"]
    assert [t.node_id for job in compiled.jobs for t in job.outputs] == ["28"]
