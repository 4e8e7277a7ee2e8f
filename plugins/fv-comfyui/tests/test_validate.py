"""ComfyUI's validate_prompt answers, over malformed and unsupported prompts built from the real
T2V/I2V fixtures: whole-prompt errors, per-node error types, partial acceptance."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from conftest import load_pair, retarget

Mutation = Callable[[dict[str, Any]], None]


@pytest.fixture
def t2v() -> dict[str, Any]:
    return retarget(load_pair("text_to_video_wan")[1])


@pytest.fixture
def i2v() -> dict[str, Any]:
    return retarget(load_pair("image_to_video_wan_example")[1])


def _types(answer: Any) -> dict[str, list[str]]:
    return {node: [e["type"] for e in entry["errors"]] for node, entry in answer.node_errors.items()}


def test_the_retargeted_fixtures_are_valid(service: Any, t2v: Any, i2v: Any) -> None:
    for prompt in (t2v, i2v, retarget(load_pair("text_to_video_wan22_14B")[1])):
        answer = service.check(prompt)
        assert answer.ok and answer.status == 200 and answer.node_errors == {}, answer.body()


# (mutation, whole-prompt error type, {node: [error types]}) — each a prompt ComfyUI or fv refuses.
CASES: list[tuple[str, Mutation, str, dict[str, list[str]]]] = [
    ("missing class_type", lambda p: p["6"].pop("class_type"), "invalid_prompt", {}),
    ("unknown node type, even unreachable", lambda p: p.update({"99": {"class_type": "ImageScale", "inputs": {}}}),
     "missing_node_type", {}),
    ("no output node", lambda p: p.pop("28"), "prompt_no_outputs", {}),
    ("required input missing", lambda p: p["3"]["inputs"].pop("steps"), "prompt_outputs_failed_validation",
     {"3": ["required_input_missing"]}),
    ("bad linked input", lambda p: p["8"]["inputs"].update(vae=["39", 0, 1]), "prompt_outputs_failed_validation",
     {"8": ["bad_linked_input"]}),
    ("return type mismatch", lambda p: p["3"]["inputs"].update(model=["38", 0]), "prompt_outputs_failed_validation",
     {"3": ["return_type_mismatch"]}),
    ("not convertible to INT", lambda p: p["3"]["inputs"].update(steps="many"), "prompt_outputs_failed_validation",
     {"3": ["invalid_input_type"]}),
    ("below min", lambda p: p["3"]["inputs"].update(steps=0), "prompt_outputs_failed_validation",
     {"3": ["value_smaller_than_min"]}),
    ("above max", lambda p: p["3"]["inputs"].update(cfg=100.5), "prompt_outputs_failed_validation",
     {"3": ["value_bigger_than_max"]}),
    ("seed above fv's max", lambda p: p["3"]["inputs"].update(seed=2**63), "prompt_outputs_failed_validation",
     {"3": ["value_bigger_than_max"]}),
    ("unmapped sampler dpmpp_2m", lambda p: p["3"]["inputs"].update(sampler_name="dpmpp_2m"), "prompt_outputs_failed_validation",
     {"3": ["value_not_in_list"]}),
    ("unmapped scheduler karras", lambda p: p["3"]["inputs"].update(scheduler="karras"), "prompt_outputs_failed_validation",
     {"3": ["value_not_in_list"]}),
    ("model file with no mapping", lambda p: p["37"]["inputs"].update(unet_name="other.safetensors"),
     "prompt_outputs_failed_validation", {"37": ["value_not_in_list"]}),
    ("link to a missing node", lambda p: p["8"]["inputs"].update(samples=["77", 0]), "prompt_outputs_failed_validation",
     {"8": ["exception_during_inner_validation"]}),
    ("output holds a link to a missing node", lambda p: p["28"]["inputs"].update(images=["77", 0]),
     "prompt_outputs_failed_validation", {"28": ["exception_during_validation"]}),
    ("slot out of range", lambda p: p["8"]["inputs"].update(vae=["39", 3]), "prompt_outputs_failed_validation",
     {"8": ["exception_during_inner_validation"]}),
    ("node without inputs", lambda p: p["39"].pop("inputs"), "prompt_outputs_failed_validation",
     {"39": ["exception_during_inner_validation"]}),
    ("link cycle", lambda p: p["48"]["inputs"].update(model=["48", 0]), "prompt_outputs_failed_validation",
     {"48": ["dependency_cycle"]}),
    ("several errors on one node", lambda p: p["40"]["inputs"].update(width=8, batch_size=0),
     "prompt_outputs_failed_validation", {"40": ["value_smaller_than_min", "value_smaller_than_min"]}),
    ("LoRA file not in the LoRA folder (a mapped model name is no LoRA)", lambda p: p.update({"90": {
        "class_type": "LoraLoaderModelOnly", "inputs": {"model": ["37", 0], "lora_name": "wan_2.1_vae.safetensors",
                                                        "strength_model": 1.0}}}) or p["48"]["inputs"].update(model=["90", 0]),
     "prompt_outputs_failed_validation", {"90": ["value_not_in_list"]}),
    # refused by fv's compiler, in the same shape
    ("partial denoise", lambda p: p["3"]["inputs"].update(denoise=0.5), "prompt_outputs_failed_validation",
     {"3": ["custom_validation_failed"]}),
    ("batch of two", lambda p: p["40"]["inputs"].update(batch_size=2), "prompt_outputs_failed_validation",
     {"40": ["custom_validation_failed"]}),
    # (fp8 weight_dtype values: their precision paths and refusals, test_precision.py)
    ("weight dtype ComfyUI does not list", lambda p: p["37"]["inputs"].update(weight_dtype="fp4"),
     "prompt_outputs_failed_validation", {"37": ["value_not_in_list"]}),
    ("loaders of two cards", lambda p: p["37"]["inputs"].update(unet_name="wan2.1_i2v_480p_14B_fp16.safetensors"),
     "prompt_outputs_failed_validation", {"3": ["custom_validation_failed"]}),
    ("one sampler on the two-expert card",
     lambda p: p["37"]["inputs"].update(unet_name="wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors"),
     "prompt_outputs_failed_validation", {"3": ["custom_validation_failed"]}),
    ("size off the card's grid (ComfyUI does not enforce step)", lambda p: p["40"]["inputs"].update(width=40),
     "prompt_outputs_failed_validation", {"3": ["custom_validation_failed"]}),
    ("clip type other than wan", lambda p: p["38"]["inputs"].update(type="sd3"), "prompt_outputs_failed_validation",
     {"38": ["custom_validation_failed"]}),
]


@pytest.mark.parametrize(("name", "mutate", "error", "node_errors"), CASES, ids=[c[0] for c in CASES])
def test_refused_prompts(service: Any, t2v: dict[str, Any], name: str, mutate: Mutation, error: str,
                         node_errors: dict[str, list[str]]) -> None:
    mutate(t2v)
    answer = service.check(t2v)
    assert not answer.ok and answer.status == 400 and answer.jobs == []
    assert answer.error["type"] == error, answer.body()
    assert set(answer.error) == {"type", "message", "details", "extra_info"}
    assert _types(answer) == node_errors, answer.body()
    for entry in answer.node_errors.values():
        assert set(entry) == {"errors", "dependent_outputs", "class_type"} and entry["dependent_outputs"] == ["28"]
        for e in entry["errors"]:
            assert set(e) == {"type", "message", "details", "extra_info"}


def test_at_least_fifteen_refusals_are_tested() -> None:
    assert len(CASES) >= 15


def test_messages_are_comfyuis(service: Any, t2v: dict[str, Any]) -> None:
    t2v["3"]["inputs"]["scheduler"] = "karras"
    t2v["3"]["inputs"]["steps"] = 0
    t2v.update({"5": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {}}})  # unreachable: never validated
    answer = service.check(t2v)
    errors = answer.node_errors["3"]["errors"]
    assert errors[0] == {"type": "value_smaller_than_min", "message": "Value 0 smaller than min of 1", "details": "steps",
                         "extra_info": {"input_name": "steps", "input_config": ["INT", {"default": 20, "min": 1, "max": 10000, "step": 1}],
                                        "received_value": 0}}
    assert errors[1]["message"] == "Value not in list"
    assert errors[1]["details"] == "scheduler: 'karras' not in ['simple', 'normal', 'sgm_uniform']"
    assert "5" not in answer.node_errors
    assert answer.error["message"] == "Prompt outputs failed validation"


def test_literals_are_converted_as_comfyui_does(service: Any, t2v: dict[str, Any]) -> None:
    t2v["3"]["inputs"].update(steps="2", cfg="4")
    answer = service.check(t2v)
    assert answer.ok, answer.body()
    assert answer.prompt["3"]["inputs"]["steps"] == 2 and answer.prompt["3"]["inputs"]["cfg"] == 4.0
    assert answer.jobs[0].options["steps"] == 2


def test_missing_node_type_names_the_node(service: Any, t2v: dict[str, Any]) -> None:
    t2v["48"]["class_type"] = "ModelSamplingFlux"
    answer = service.check(t2v)
    assert answer.error == {
        "type": "missing_node_type", "message": "Node 'ModelSamplingSD3' not found. The custom node may not be installed.",
        "details": "Node ID '#48'", "extra_info": {"node_id": "48", "class_type": "ModelSamplingFlux", "node_title": "ModelSamplingSD3"},
    }


def test_return_type_mismatch_does_not_enter_the_linked_node(service: Any, t2v: dict[str, Any]) -> None:
    t2v["95"] = {"class_type": "CLIPLoader", "inputs": {  # reached only through the mismatched link
        "clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "not-a-type", "device": "default"}}
    t2v["3"]["inputs"]["model"] = ["95", 0]
    answer = service.check(t2v)
    assert _types(answer) == {"3": ["return_type_mismatch"]}  # 95's bad type is never looked at
    assert answer.node_errors["3"]["errors"][0]["details"] == "model, received_type(CLIP) mismatch input_type(MODEL)"
    # Negative control: linked where the types match, the same bad value is found.
    t2v["6"]["inputs"]["clip"] = ["95", 0]
    assert _types(service.check(t2v)) == {"3": ["return_type_mismatch"], "95": ["value_not_in_list"]}


def test_partly_valid_prompt_is_accepted_with_node_errors(service: Any, t2v: dict[str, Any]) -> None:
    t2v["47"] = {"class_type": "SaveWEBM", "inputs": {"filename_prefix": "x", "codec": "vp9", "fps": 24.0, "crf": 99.0,
                                                     "images": ["8", 0]}}
    answer = service.check(t2v)
    assert answer.ok and answer.status == 200
    assert _types(answer) == {"47": ["value_bigger_than_max"]}
    assert answer.node_errors["47"]["dependent_outputs"] == ["47"]
    assert [t.node_id for job in answer.jobs for t in job.outputs] == ["28"]  # only the valid output runs


def test_load_image_missing_file_is_custom_validation_failed(service: Any, i2v: dict[str, Any]) -> None:
    i2v["52"]["inputs"]["image"] = "absent.png"
    answer = service.check(i2v)
    assert _types(answer) == {"52": ["custom_validation_failed"]}
    assert answer.node_errors["52"]["errors"][0]["details"] == "image - Invalid image file: absent.png"
    i2v["52"]["inputs"]["image"] = "../flux_dev_example.png"  # never outside the input folder
    assert _types(service.check(i2v)) == {"52": ["custom_validation_failed"]}


def test_i2v_crop_none_needs_a_square_image(service: Any, i2v: dict[str, Any]) -> None:
    assert service.check(i2v).ok  # the fixture's crop 'none' on a square image
    i2v["52"]["inputs"]["image"] = "wide.png"
    answer = service.check(i2v)
    assert _types(answer) == {"51": ["custom_validation_failed"]}
    i2v["51"]["inputs"]["crop"] = "center"
    assert service.check(i2v).ok


def test_not_an_object(service: Any) -> None:
    answer = service.check(["not", "a", "prompt"])
    assert answer.error["type"] == "invalid_prompt" and answer.status == 400


def test_validation_does_not_change_the_callers_prompt(service: Any, t2v: dict[str, Any]) -> None:
    t2v["3"]["inputs"]["steps"] = "2"
    before = copy.deepcopy(t2v)
    service.check(t2v)
    assert t2v == before
