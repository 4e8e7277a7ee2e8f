"""Test session setup and shared fixtures for fv-wan's CPU tests.

The fixtures are factories (pytest fixtures returning callables) so every test file
builds fv runs and their diffusers counterparts the same way without importing conftest.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
from PIL import Image

# The tiny models are far below the size where intra-op threads pay off, and on a shared
# machine OpenMP workers spinning against other processes make each op ~100x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def wan_card() -> Callable[..., Any]:
    """``wan_card(model_id, **denoise_config)``: a fv-wan card, its denoise loop config overridden."""
    from fv_wan.cards import wan_cards

    cards = {card.model_id: card for card in wan_cards()}

    def get(model_id: str, **denoise_config: Any) -> Any:
        card = cards[model_id]
        if not denoise_config:
            return card
        loops = dict(card.loops)
        for loop_id, spec in card.loops.items():
            if spec.kind == "diffusion_denoise":
                loops[loop_id] = spec.model_copy(update={"config": {**spec.config, **denoise_config}})
        return card.model_copy(update={"loops": loops})

    return get


@pytest.fixture(scope="session")
def condition_image() -> Callable[[int, int, int], tuple[Image.Image, torch.Tensor]]:
    """``condition_image(height, width, seed) -> (PIL image, the same pixels as fv's (3, H, W) tensor)``.

    uint8 pixels, so the PIL path (diffusers) and the tensor path (fv) see identical values.
    """

    def make(height: int, width: int, seed: int = 0) -> tuple[Image.Image, torch.Tensor]:
        rng = np.random.default_rng(seed)
        # Smooth content (a gradient plus mild noise) rather than white noise, like a real image.
        yy, xx = np.mgrid[0:height, 0:width]
        base = np.stack([xx / width, yy / height, (xx + yy) / (width + height)], axis=-1) * 200
        pixels = np.clip(base + rng.integers(0, 56, (height, width, 3)), 0, 255).astype(np.uint8)
        tensor = torch.from_numpy(pixels.astype(np.float32) / 255.0).permute(2, 0, 1).contiguous()
        return Image.fromarray(pixels, mode="RGB"), tensor

    return make


@pytest.fixture(scope="session")
def fv_request() -> Callable[..., Any]:
    """``fv_request(card, prompt, negative_prompt=None, *, image=None, seed=0, **diffusion)``: a fv request."""
    from fv_kernel.api import DiffusionParams, ImagePart, Request, TaskType, TextPart

    def make(
        card: Any, prompt: str, negative_prompt: str | None = None, *, image: torch.Tensor | None = None,
        seed: int = 0, **diffusion: Any,
    ) -> Any:
        inputs: list[Any] = [TextPart(text=prompt)]
        if negative_prompt is not None:
            inputs.append(TextPart(text=negative_prompt, role="negative_prompt"))
        if image is not None:
            inputs.append(ImagePart(image=image))
        task = TaskType.IMAGE_TO_VIDEO if image is not None else TaskType.TEXT_TO_VIDEO
        return Request(model=card.model_id, task=task, inputs=tuple(inputs), diffusion=DiffusionParams(seed=seed, **diffusion))

    return make


@pytest.fixture(scope="session")
def reference_modules() -> Callable[[Any], dict[str, Any]]:
    """``reference_modules(instance)``: diffusers/transformers modules holding the instance's exact weights.

    Keys: ``transformer`` (and ``transformer_2``) as ``WanTransformer3DModel``, ``vae`` as
    ``AutoencoderKLWan``, and the very ``text_encoder``/``tokenizer``/``image_encoder``
    objects fv holds (they are transformers modules already). Load every component first
    (``instance.load_for_task``): the VAE takes the encoder and decoder halves fv loaded.
    """
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    def build(instance: Any) -> dict[str, Any]:
        card, comps = instance.card, instance.components
        out: dict[str, Any] = {}
        for expert in ("transformer", "transformer_2"):
            if expert in comps:
                module = WanTransformer3DModel(**card.components[expert].config).eval()
                module.load_state_dict(comps[expert].state_dict(), strict=True)
                out[expert] = module
        vae = AutoencoderKLWan(**card.components["vae_decoder"].config).eval()
        weights = {**comps["vae_decoder"].state_dict(), **(comps["vae_encoder"].state_dict() if "vae_encoder" in comps else {})}
        result = vae.load_state_dict(weights, strict=False)
        assert not result.unexpected_keys, result.unexpected_keys
        # Only the encoder half may be absent (text-to-video never loads it).
        assert all(k.startswith(("encoder.", "quant_conv.")) for k in result.missing_keys), result.missing_keys
        out["vae"] = vae
        out["text_encoder"] = comps["text_encoder"].model
        out["tokenizer"] = comps["text_encoder"].tokenizer
        if "image_encoder" in comps:
            out["image_encoder"] = comps["image_encoder"].model
        return out

    return build


@pytest.fixture(scope="session")
def unipc_scheduler() -> Callable[[float], Any]:
    """diffusers' scheduler for Wan's released config at a given flow shift."""
    from diffusers import UniPCMultistepScheduler

    def make(shift: float) -> Any:
        return UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=shift
        )

    return make
