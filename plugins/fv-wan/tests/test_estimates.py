"""Wan's admission estimates: real dimensions, every loop's peak, the steps each loop runs.

* the denoise estimate at the released 1.3B and 14B configs equals the figure derived by
  hand from those configs (no weights: cards validate, and estimate, without them);
* changing the transformer's width changes it (the old estimate hard-coded width 1536);
* every loop reserves its peak: text and image encode and the VAE decode too, and at
  video sizes the decode peak exceeds the denoise peak of the 1.3B model;
* the decode loop's causal-history model equals the bytes the real (tiny) VAE keeps;
* on every tiny card, each estimate prices exactly the steps its loop runs, with the
  same kind, shape and precision the engine's cost model calibrates.
"""

from __future__ import annotations

import pytest
import torch

from fv_kernel.api import (
    DiffusionParams,
    Engine,
    ImagePart,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    build_instance,
    resolve_request,
)
from fv_kernel.testing import StepRecorder, assert_estimate_covers_execution
from fv_wan import footprint
from fv_wan.cards import wan_cards
from fv_wan.models.transformer import WanTransformerConfig
from fv_wan.models.vae import WanVAE, WanVAEConfig

CARDS = {card.model_id: card for card in wan_cards()}


def _estimate(model_id: str, loop_id: str, card=None, **diffusion):  # type: ignore[no-untyped-def]
    instance = build_instance(card or CARDS[model_id])
    request = resolve_request(instance.card, Request(model=model_id, task=TaskType.TEXT_TO_VIDEO,
                                                     inputs=(TextPart(text="a fox"),), diffusion=DiffusionParams(**diffusion)))
    return instance.loop(loop_id).estimate(request, instance)


def _hand_dit_peak(*, tokens: int, positions: int, d: int, f: int) -> int:
    """The documented model (fv_wan.footprint), written out for bf16 (e = 2), one row, 512 text tokens."""
    attention = max(9 * 2 + 4, 7 * 2 + 4 + 6) * d
    ffn = (4 * 2 + 4) * d + 2 * 2 * f
    residual = (4 * 2 + 12) * d
    per_token = max(attention, ffn, residual) + 128 * 4  # + RoPE tables: head_dim 128, fp32
    modulation = d * (6 * 4 + 7 * 2)
    context = 3 * 512 * d * 2
    io = positions * (16 * 2 + 16 * 4)  # the bf16 input latents in, the fp32 velocity out (16 channels)
    return io + int(1.05 * (tokens * per_token + modulation + context))


def test_denoise_peak_at_the_released_1_3b_config_is_the_hand_derived_figure() -> None:
    # 480x832, 81 frames -> latent 21 x 60 x 104; patch (1, 2, 2) -> 21 * 30 * 52 tokens; width 12 x 128, FFN 8960.
    estimate = _estimate("wan2.1-t2v-1.3b", "denoise")
    assert estimate.peak_bytes == _hand_dit_peak(tokens=21 * 30 * 52, positions=21 * 60 * 104, d=1536, f=8960)
    # 32760 x 54784 + 58368 + 4718592 = 1_799_500_800; x 1.05 = 1_889_475_840; + 131040 x 96 = 1_902_055_680 (1.77 GiB)
    assert estimate.peak_bytes == 1_902_055_680


def test_denoise_peak_at_the_released_14b_config_is_the_hand_derived_figure() -> None:
    # 720x1280, 81 frames -> latent 21 x 90 x 160; 21 * 45 * 80 tokens; width 40 x 128, FFN 13824.
    estimate = _estimate("wan2.1-t2v-14b", "denoise")
    assert estimate.peak_bytes == _hand_dit_peak(tokens=21 * 45 * 80, positions=21 * 90 * 160, d=5120, f=13824)


def test_negative_control_the_estimate_follows_the_configs_width() -> None:
    card = CARDS["wan2.1-t2v-1.3b"]
    wider = WanTransformerConfig.from_diffusers_config(card.components["transformer"].config).model_copy(
        update={"num_attention_heads": 16})
    components = dict(card.components)
    components["transformer"] = components["transformer"].model_copy(update={"config": wider.to_diffusers_config()})
    changed = card.model_copy(update={"components": components})
    base = _estimate("wan2.1-t2v-1.3b", "denoise").peak_bytes
    assert _estimate("wan2.1-t2v-1.3b", "denoise", card=changed).peak_bytes == _hand_dit_peak(
        tokens=21 * 30 * 52, positions=21 * 60 * 104, d=2048, f=8960) != base


def test_every_loop_reserves_its_peak_and_decode_outgrows_denoise_at_video_sizes() -> None:
    text = _estimate("wan2.1-t2v-1.3b", "text_encode")
    denoise = _estimate("wan2.1-t2v-1.3b", "denoise")
    decode = _estimate("wan2.1-t2v-1.3b", "decode")
    assert text.peak_bytes > 0 and text.resident_bytes == 2 * 512 * 4096 * 4, "fp32 prompt + negative embeddings"
    assert decode.peak_bytes > denoise.peak_bytes, "81 frames at 480x832: the decode step is the larger transient"
    assert decode.resident_bytes > 81 * 3 * 480 * 832 * 4, "the decoded frames and the causal history stay"
    # Decoding reads the VAE's dimensions: a wider decoder reserves more.
    card = CARDS["wan2.1-t2v-1.3b"]
    vae = WanVAEConfig.from_diffusers_config(card.components["vae_decoder"].config).model_copy(update={"decoder_base_dim": 128})
    components = dict(card.components)
    components["vae_decoder"] = components["vae_decoder"].model_copy(update={"config": vae.to_diffusers_config()})
    wider = _estimate("wan2.1-t2v-1.3b", "decode", card=card.model_copy(update={"components": components}))
    assert wider.peak_bytes > decode.peak_bytes and wider.resident_bytes > decode.resident_bytes


def test_decode_on_cuda_keeps_its_frames_on_the_host() -> None:
    # The CUDA op copies each step's frames to pinned host memory: only the causal history stays.
    card = CARDS["wan2.1-t2v-1.3b"]
    request = resolve_request(card, Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO,
                                            inputs=(TextPart(text="a fox"),)))
    instance = build_instance(card)  # estimates read the card and the device, never weights
    host = instance.loop("decode").estimate(request, instance)
    instance.options = instance.options.model_copy(update={"device": "cuda"})  # no CUDA here to build on
    cuda = instance.loop("decode").estimate(request, instance)
    assert host.resident_bytes - cuda.resident_bytes == 81 * 3 * 480 * 832 * 4
    assert cuda.peak_bytes == host.peak_bytes


def test_image_encode_reserves_the_vae_encode_of_the_whole_condition_video() -> None:
    instance = build_instance(CARDS["wan2.1-i2v-14b-480p"])
    request = resolve_request(instance.card, Request(
        model="wan2.1-i2v-14b-480p", task=TaskType.IMAGE_TO_VIDEO,
        inputs=(TextPart(text="a fox"), ImagePart(image=torch.rand(3, 480, 832)))))
    estimate = instance.loop("image_encode").estimate(request, instance)
    vae = WanVAEConfig.from_diffusers_config(instance.card.components["vae_encoder"].config)
    encode = footprint.vae_encode_peak_bytes(vae, 480, 832, frames=81, element=4)
    assert estimate.peak_bytes == 3 * 81 * 480 * 832 * 4 + encode, "the fp32 pixels on the device, then the encoder"


def test_the_decode_history_model_equals_what_the_real_vae_keeps() -> None:
    config = WanVAEConfig.from_diffusers_config(CARDS["wan-tiny"].components["vae_decoder"].config)
    torch.manual_seed(0)
    vae = WanVAE(config).eval()
    cache = vae.new_decode_cache()
    with torch.inference_mode():
        for _ in range(3):  # the history reaches its steady size from the third frame
            _, cache = vae.decode_step(torch.randn(1, config.z_dim, 1, 6, 10), cache)
    kept = sum(t.numel() * t.element_size() for name, t in cache.to_tensors().items() if not name.startswith("meta."))
    assert kept == footprint.vae_decode_step(config, 6, 10, element=4).cache_bytes


def _request(model_id: str, task: TaskType = TaskType.TEXT_TO_VIDEO, **diffusion) -> Request:  # type: ignore[no-untyped-def]
    inputs: tuple = (TextPart(text="a red fox"),)
    if task is TaskType.IMAGE_TO_VIDEO:
        inputs += (ImagePart(image=torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))),)
    return Request(model=model_id, task=task, inputs=inputs,
                   diffusion=DiffusionParams(height=32, width=32, frames=5, seed=1, **diffusion))


@pytest.mark.parametrize(
    "request_",
    [
        _request("wan-tiny", steps=3),
        _request("wan-tiny", steps=2, guidance=1.0, sampler="euler"),
        _request("wan-tiny-i2v", TaskType.IMAGE_TO_VIDEO, steps=2),
        _request("wan-tiny-ti2v", TaskType.IMAGE_TO_VIDEO, steps=2),
        _request("wan-tiny-a14b", steps=4),
        _request("fastwan-tiny"),
    ],
    ids=["t2v-cfg", "t2v-euler-nocfg", "i2v-concat", "ti2v-first-frame", "two-experts", "dmd-3-step"],
)
def test_each_estimate_prices_the_steps_its_loop_runs(request_: Request) -> None:
    engine = Engine(SchedulerConfig(device_thread=False), observers=[StepRecorder()])
    engine.add_instance(build_instance(CARDS[request_.model]))
    assert_estimate_covers_execution(engine, request_)
