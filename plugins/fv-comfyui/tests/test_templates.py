"""ComfyUI's official Wan 2.2 templates' node types: ``UNETLoader`` with an fp8 ``weight_dtype`` (its
precision path: test_precision.py), ``Wan22ImageToVideoLatent`` (TI2V-5B: image-to-video with a start
image, text-to-video without), ``CreateVideo`` / ``SaveVideo``.

The prompts are ``fixtures/wan22_*.api.json``, written from ComfyUI's node definitions (SOURCES.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TEMPLATES, load_api, retarget
from fv_comfyui.nodes import NODE_SPECS, object_info
from fv_comfyui.run import JobRunner
from test_equivalence import _fv_generate, one_thread  # noqa: F401 - the fixture keeps both sides on one thread
from test_precision import service_with_paths as with_paths


@pytest.mark.parametrize("name", TEMPLATES)
def test_each_template_compiles(name: str, service: Any) -> None:
    # On cards whose contracts list the fp8 paths (test_precision.py): the fp8 template's
    # fp8_e4m3fn_fast loaders run fp8_dynamic.
    answer = with_paths(service, "fp8_weights", "fp8_dynamic").check(retarget(load_api(name)))
    assert answer.ok, answer.body()
    (job,) = answer.jobs
    expected = {"wan22_ti2v_5B_i2v": ("wan-tiny-ti2v", "image_to_video", "example.png", None),
                "wan22_ti2v_5B_t2v": ("wan-tiny-ti2v", "text_to_video", None, None),
                "wan22_14B_t2v_fp8": ("wan-tiny-a14b", "text_to_video", None, "fp8_dynamic")}[name]
    assert (job.card.model_id, job.task.value, job.image_name, job.precision_path) == expected
    assert [(t.class_type, t.format) for t in job.outputs] == [("SaveVideo", "mp4")]


def test_an_unknown_weight_dtype_is_still_value_not_in_list(service: Any) -> None:
    prompt = retarget(load_api("wan22_ti2v_5B_t2v"))
    prompt["37"]["inputs"]["weight_dtype"] = "fp4"
    answer = service.check(prompt)
    assert not answer.ok and answer.node_errors["37"]["errors"][0]["type"] == "value_not_in_list"


def test_wan22_latent_node_is_comfyuis() -> None:
    # ComfyUI's comfy_extras/nodes_wan.py, Wan22ImageToVideoLatent.define_schema, written out here.
    info = object_info({})["Wan22ImageToVideoLatent"]
    assert info["input"] == {
        "required": {
            "vae": ["VAE"],
            "width": ["INT", {"default": 1280, "min": 32, "max": 16384, "step": 32}],
            "height": ["INT", {"default": 704, "min": 32, "max": 16384, "step": 32}],
            "length": ["INT", {"default": 49, "min": 1, "max": 16384, "step": 4}],
            "batch_size": ["INT", {"default": 1, "min": 1, "max": 4096}],
        },
        "optional": {"start_image": ["IMAGE"]},
    }
    assert info["output"] == ["LATENT"] and info["output_node"] is False
    assert NODE_SPECS["Wan22ImageToVideoLatent"].input("start_image").optional


def test_wan22_latent_options_are_the_requests(service: Any) -> None:
    prompt = retarget(load_api("wan22_ti2v_5B_i2v"), size=64, length=9, steps=4)
    prompt["55"]["inputs"].update(width=96, height=64)
    (job,) = service.check(prompt).jobs
    assert {k: job.options[k] for k in ("width", "height", "frames", "steps", "guidance", "shift", "sampler")} == {
        "width": 96, "height": 64, "frames": 9, "steps": 4, "guidance": 5.0, "shift": 8.0, "sampler": "comfy-uni_pc-simple"}
    request = job.request(torch.zeros(3, 40, 40))
    assert request.task.value == "image_to_video" and request.diffusion.width == 96


@pytest.mark.parametrize(("change", "node", "needle", "kind"), [
    (lambda p: p["55"]["inputs"].update(batch_size=2), "55", "batch_size must be 1", "custom_validation_failed"),
    (lambda p: p["55"]["inputs"].update(width=16), "55", "Value 16 smaller than min of 32", "value_smaller_than_min"),
    # the Wan 2.1 I2V card takes the image through CLIP vision and concat, not into the first latent frame
    (lambda p: p["37"]["inputs"].update(unet_name="wan2.1_i2v_480p_14B_fp16.safetensors")
     or p["39"]["inputs"].update(vae_name="wan_2.1_vae.safetensors"), "55", "first latent frame", "custom_validation_failed"),
    # the VAE of the latent node must belong to the card too
    (lambda p: p["39"]["inputs"].update(vae_name="wan_2.1_vae.safetensors"), "3", "do not resolve to one card",
     "custom_validation_failed"),
])
def test_wan22_latent_refusals(change: Any, node: str, needle: str, kind: str | None, service: Any) -> None:
    prompt = retarget(load_api("wan22_ti2v_5B_i2v"))
    change(prompt)
    answer = service.check(prompt)
    assert not answer.ok
    error = answer.node_errors[node]["errors"][0]
    if kind is not None:
        assert error["type"] == kind
    assert needle in error["details"] or needle in error["message"], error


def test_without_start_image_the_vae_is_still_checked(service: Any) -> None:
    prompt = retarget(load_api("wan22_ti2v_5B_t2v"))
    prompt["39"]["inputs"]["vae_name"] = "wan_2.1_vae.safetensors"  # VAEDecode and the latent node both read it
    answer = service.check(prompt)
    assert not answer.ok and "do not resolve to one card" in answer.node_errors["3"]["errors"][0]["details"]


@pytest.mark.parametrize("name", ["wan22_ti2v_5B_i2v", "wan22_ti2v_5B_t2v"])
def test_ti2v_template_equals_fv_generate(name: str, service: Any, tmp_path: Path) -> None:
    answer = service.check(retarget(load_api(name), steps=2))
    (job,) = answer.jobs
    image = service.image_path(job.image_name) if job.image_name else None
    video = JobRunner().run(job, image)
    assert video.frames.shape[0] == 5 and video.frames.shape[-2:] == (32, 32)
    args = job.fv_generate_args(job.card.model_id, str(image) if image else None)
    assert ("--image" in args) == (name == "wan22_ti2v_5B_i2v")
    expected = _fv_generate(args, tmp_path / "out.pt")
    assert torch.equal(video.frames, expected), (video.frames - expected).abs().max()
