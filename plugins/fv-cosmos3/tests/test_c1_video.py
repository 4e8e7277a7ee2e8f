"""C1 video: a T2V trajectory of the fv denoise loop equals diffusers' ``Cosmos3OmniPipeline`` given the same noise.

The pipeline is built offline from tiny components holding the same weights: the
diffusers ``Cosmos3OmniTransformer`` and ``AutoencoderKLWan`` loaded with our
instance's state dicts, a UniPC flow scheduler with the card's shift, and the HF
tokenizer surface backed by the same byte tokenizer. Both sides seed one
``torch.Generator`` identically and draw the initial noise from it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cosmos3_testutils import assert_close, drive_loop

from fv_cosmos3.cards import cosmos3_card
from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart, build_instance
from fv_kernel.runtime.local import run_local

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline  # noqa: E402

PROMPT, NEGATIVE, SEED = "a red fox runs through snow", "blurry", 3


class _HFStyleTokenizer:
    def __init__(self, tok) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_token_id

    def convert_tokens_to_ids(self, token: str) -> int:
        return self._tok.token_id(token)

    def apply_chat_template(self, conversations, **kwargs):
        return SimpleNamespace(input_ids=self._tok.chat_ids(conversations))


@pytest.fixture(scope="module")
def setup():
    card = cosmos3_card("cosmos3-tiny")
    instance = build_instance(card)
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    mot, vae, tok = instance.component("transformer"), instance.component("vae"), instance.component("tokenizer")
    transformer = diffusers.Cosmos3OmniTransformer(**mot.config.to_diffusers_kwargs()).eval()
    transformer.load_state_dict(mot.state_dict(), strict=True)
    ref_vae = diffusers.AutoencoderKLWan(**vae.config.to_diffusers_config()).eval()
    ref_vae.load_state_dict(vae.state_dict(), strict=True)
    scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = Cosmos3OmniPipeline(
        transformer=transformer, text_tokenizer=_HFStyleTokenizer(tok), vae=ref_vae, scheduler=scheduler,
        enable_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return instance, pipe


def _request(steps: int = 3) -> Request:
    return Request(
        model="cosmos3-tiny", task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text=PROMPT), TextPart(text=NEGATIVE, role="negative_prompt")),
        diffusion=DiffusionParams(seed=SEED, steps=steps, guidance=2.0, frames=5, height=32, width=64, fps=24.0),
    )


def _pipeline(pipe, output_type: str):
    with torch.no_grad():
        return pipe(
            PROMPT, negative_prompt=NEGATIVE, num_frames=5, height=32, width=64, fps=24.0, num_inference_steps=3,
            guidance_scale=2.0, generator=torch.Generator().manual_seed(SEED), output_type=output_type,
            enable_safety_check=False,
        ).video


def test_t2v_trajectory_equals_pipeline(setup):
    instance, pipe = setup
    record: list = []
    state, result = drive_loop(instance, "denoise", _request(), record=record)
    expected = _pipeline(pipe, "latent")
    ours = result.outputs["latents"]
    assert ours.abs().max() > 0.1
    assert_close(ours, expected, atol=1e-4)
    kinds = [plan.op for plan, _ in record]
    assert kinds == ["text_kv", "text_kv", "generate", "generate", "generate"]  # text K/V once per branch


def test_t2v_video_equals_pipeline(setup):
    instance, pipe = setup
    artifacts = run_local(_request(), instance)
    (video,) = [a for a in artifacts if a.kind == "video"]
    expected = _pipeline(pipe, "pt")
    assert video.frames.shape == (5, 3, 32, 64)
    assert_close(video.frames, expected.reshape(video.frames.shape), atol=1e-4)
