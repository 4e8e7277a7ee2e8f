"""C1 parity: full fv trajectories (text encode -> denoise -> streamed decode) against diffusers' Wan pipelines.

Each test builds fv's instance of a tiny card, copies its exact component weights into
diffusers' modules, runs both from the same prompt pair, seed, steps and guidance, and
compares decoded frames (CPU, fp32) to the card's ``ParitySpec`` tolerance. Nothing is
shared but weights and user-level settings: fv draws its own noise from the seed, runs its
own sampler and guidance policy, VAE and loops.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from transformers import CLIPImageProcessor

from fv_kernel.api import ModelCard, build_instance
from fv_kernel.runtime.local import run_local

SEED = 11
PROMPT = "a red fox runs through fresh snow"
NEGATIVE = "blurry, low quality"


def _tolerance(card: ModelCard) -> float:
    (tolerance,) = [t for t in card.parity.tolerances if t.name == "loop_vs_diffusers" and t.dtype == "fp32"]
    assert tolerance.metric == "max_abs"
    return tolerance.value


def _fv_video(card: ModelCard, request: Any) -> tuple[torch.Tensor, Any]:
    instance = build_instance(card)
    (video,) = run_local(request, instance)
    return video.frames, instance


def _compare(card: ModelCard, fv: torch.Tensor, reference: torch.Tensor) -> float:
    """Max abs difference of fv's (F, 3, H, W) frames and diffusers' (1, F, 3, H, W) output."""
    assert reference.shape[0] == 1 and fv.shape == reference.shape[1:], (fv.shape, reference.shape)
    # The frames carry content (a degenerate constant video would match trivially).
    assert fv.std() > 0.02 and 0.0 <= fv.min() and fv.max() <= 1.0
    diff = (fv - reference[0]).abs().max().item()
    assert diff <= _tolerance(card), f"{card.model_id}: max abs diff {diff:.3g} > {_tolerance(card):.1g}"
    return diff


def _pipeline_kwargs(card: ModelCard, **overrides: Any) -> dict[str, Any]:
    d = card.capabilities.defaults
    assert d is not None
    kwargs = dict(
        prompt=PROMPT, negative_prompt=NEGATIVE, height=d.height, width=d.width, num_frames=d.frames,
        num_inference_steps=d.steps, guidance_scale=d.guidance, generator=torch.Generator().manual_seed(SEED),
        output_type="pt",
    )
    kwargs.update(overrides)
    return kwargs


def _t2v_pipeline(card: ModelCard, ref: dict[str, Any], scheduler: Any, **config: Any) -> WanPipeline:
    pipe = WanPipeline(
        tokenizer=ref["tokenizer"], text_encoder=ref["text_encoder"], vae=ref["vae"], scheduler=scheduler,
        transformer=ref["transformer"], transformer_2=ref.get("transformer_2"), **config,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("dispatch", ["batched", "sequential"])
def test_t2v_trajectory_matches_wan_pipeline(dispatch, wan_card, fv_request, reference_modules, unipc_scheduler) -> None:
    card = wan_card("wan-tiny", cfg_dispatch=dispatch)
    fv, instance = _fv_video(card, fv_request(card, PROMPT, NEGATIVE, seed=SEED))
    # Text-to-video loads neither the VAE encoder nor an image encoder.
    assert set(instance.components) == {"transformer", "vae_decoder", "text_encoder"}
    ref = reference_modules(instance)
    pipe = _t2v_pipeline(card, ref, unipc_scheduler(card.capabilities.defaults.shift))
    reference = pipe(**_pipeline_kwargs(card)).frames
    _compare(card, fv, reference)
    # The comparison can fail: another seed moves the frames far beyond the tolerance.
    other = pipe(**_pipeline_kwargs(card, generator=torch.Generator().manual_seed(SEED + 1))).frames
    assert (other[0] - fv).abs().max() > 50 * _tolerance(card)


def test_i2v_trajectory_matches_wan_i2v_pipeline(wan_card, fv_request, reference_modules, unipc_scheduler, condition_image) -> None:
    card = wan_card("wan-tiny-i2v")
    d = card.capabilities.defaults
    pil, pixels = condition_image(d.height, d.width, 3)
    fv, instance = _fv_video(card, fv_request(card, PROMPT, NEGATIVE, image=pixels, seed=SEED))
    assert {"vae_encoder", "image_encoder"} <= set(instance.components)
    ref = reference_modules(instance)
    clip_size = ref["image_encoder"].config.image_size
    # fv's built-in CLIP preprocessing equals CLIPImageProcessor's defaults at the tower's size (C0-tested).
    processor = CLIPImageProcessor(size=clip_size, crop_size=clip_size)
    pipe = WanImageToVideoPipeline(
        tokenizer=ref["tokenizer"], text_encoder=ref["text_encoder"], vae=ref["vae"],
        scheduler=unipc_scheduler(d.shift), image_processor=processor, image_encoder=ref["image_encoder"],
        transformer=ref["transformer"],
    )
    pipe.set_progress_bar_config(disable=True)
    # The image branch is reached: image_dim and added K/V are set, and the text context is exactly 512 tokens.
    assert pipe.transformer.config.image_dim is not None and pipe.transformer.config.added_kv_proj_dim is not None
    reference = pipe(image=pil, **_pipeline_kwargs(card, max_sequence_length=512)).frames
    _compare(card, fv, reference)
    # Conditioning matters: a different image moves the frames far beyond the tolerance.
    other_pil, _ = condition_image(d.height, d.width, 4)
    other = pipe(image=other_pil, **_pipeline_kwargs(card)).frames
    assert (other[0] - fv).abs().max() > 50 * _tolerance(card)


def test_ti2v_text_to_video_matches_expand_timesteps_pipeline(wan_card, fv_request, reference_modules, unipc_scheduler) -> None:
    card = wan_card("wan-tiny-ti2v")
    fv, instance = _fv_video(card, fv_request(card, PROMPT, NEGATIVE, seed=SEED))
    assert "vae_encoder" not in instance.components
    ref = reference_modules(instance)
    pipe = _t2v_pipeline(card, ref, unipc_scheduler(card.capabilities.defaults.shift), expand_timesteps=True)
    _compare(card, fv, pipe(**_pipeline_kwargs(card)).frames)


def test_ti2v_image_to_video_keeps_first_frame_clean(wan_card, fv_request, reference_modules, unipc_scheduler, condition_image) -> None:
    card = wan_card("wan-tiny-ti2v")
    d = card.capabilities.defaults
    pil, pixels = condition_image(d.height, d.width, 5)
    fv, instance = _fv_video(card, fv_request(card, PROMPT, NEGATIVE, image=pixels, seed=SEED))
    assert "vae_encoder" in instance.components and "image_encoder" not in instance.components
    ref = reference_modules(instance)
    pipe = WanImageToVideoPipeline(
        tokenizer=ref["tokenizer"], text_encoder=ref["text_encoder"], vae=ref["vae"],
        scheduler=unipc_scheduler(d.shift), transformer=ref["transformer"], expand_timesteps=True,
    )
    pipe.set_progress_bar_config(disable=True)
    _compare(card, fv, pipe(image=pil, **_pipeline_kwargs(card)).frames)


def test_a14b_two_experts_match_boundary_pipeline(wan_card, fv_request, reference_modules, unipc_scheduler) -> None:
    card = wan_card("wan-tiny-a14b")
    d = card.capabilities.defaults
    assert d.guidance_2 is not None and d.guidance_2 != d.guidance
    fv, instance = _fv_video(card, fv_request(card, PROMPT, NEGATIVE, seed=SEED))
    ref = reference_modules(instance)
    boundary = card.loops["denoise"].config["boundary_ratio"]
    assert boundary == 0.875
    pipe = _t2v_pipeline(card, ref, unipc_scheduler(d.shift), boundary_ratio=boundary)
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        ref[name].register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    reference = pipe(**_pipeline_kwargs(card, guidance_scale_2=d.guidance_2)).frames
    # Both experts ran (two forwards per step with CFG), so the switch and guidance_2 are exercised.
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0, calls
    assert calls["transformer"] + calls["transformer_2"] == 2 * d.steps
    _compare(card, fv, reference)


def test_dmd_three_step_loop_matches_hand_written_dmd(wan_card, fv_request, reference_modules, unipc_scheduler) -> None:
    """No diffusers pipeline runs DMD2; the reference is FastVideo's loop written out here over diffusers modules."""
    card = wan_card("fastwan-tiny")
    d = card.capabilities.defaults
    fv, instance = _fv_video(card, fv_request(card, PROMPT, seed=SEED))  # no CFG: no negative prompt
    ref = reference_modules(instance)
    pipe = _t2v_pipeline(card, ref, unipc_scheduler(d.shift))  # only its prompt encoder and VAE factors are used
    with torch.no_grad():
        # encode_prompt defaults to 226 tokens; WanPipeline.__call__ (and fv) use 512, and the zero padding
        # tokens still take part in cross-attention, so the length matters.
        prompt_embeds, _ = pipe.encode_prompt(
            PROMPT, do_classifier_free_guidance=False, max_sequence_length=512, device=torch.device("cpu")
        )
        vae_cfg = ref["vae"].config
        t_factor, s_factor = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
        shape = (1, vae_cfg.z_dim, (d.frames - 1) // t_factor + 1, d.height // s_factor, d.width // s_factor)
        generator = torch.Generator().manual_seed(SEED)
        x = torch.randn(shape, generator=generator, dtype=torch.float32)
        # FastWan's denoising_timesteps live in the shifted scheduler space: sigma = t / 1000.
        sigmas = [t / 1000.0 for t in card.loops["dmd_3step"].sampler.config["denoising_timesteps"]]
        for i, sigma in enumerate(sigmas):
            timestep = torch.tensor([sigma * 1000.0], dtype=torch.float32)
            velocity = ref["transformer"](x, timestep, prompt_embeds, return_dict=False)[0]
            x0 = x - sigma * velocity
            if i + 1 == len(sigmas):
                x = x0
            else:  # re-noise to the next sigma with fresh noise from the same seeded generator
                noise = torch.randn(shape, generator=generator, dtype=torch.float32)
                x = sigmas[i + 1] * noise + (1 - sigmas[i + 1]) * x0
        mean = torch.tensor(vae_cfg.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae_cfg.latents_std).view(1, -1, 1, 1, 1)
        video = ref["vae"].decode(x * std + mean, return_dict=False)[0]
    reference = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
    _compare(card, fv, reference)

