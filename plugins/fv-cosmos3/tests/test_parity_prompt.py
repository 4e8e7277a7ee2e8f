"""Generation-prompt token ids equal the diffusers pipeline's ``tokenize_prompt`` (same tokenizer on both sides)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fv_cosmos3.models.tokenizer import ByteTokenizer, PromptSpec, build_generation_prompt, render_qwen_chat

diffusers_pipeline = pytest.importorskip("diffusers.pipelines.cosmos.pipeline_cosmos3_omni")


class _HFStyleByteTokenizer:
    """The HF tokenizer surface the diffusers pipeline calls, backed by ByteTokenizer."""

    def __init__(self, tok: ByteTokenizer) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_token_id

    def convert_tokens_to_ids(self, token: str) -> int:
        return self._tok.token_id(token)

    def apply_chat_template(self, conversations, **kwargs):
        assert kwargs == dict(tokenize=True, add_generation_prompt=True, add_vision_id=False, return_dict=True)
        return SimpleNamespace(input_ids=self._tok.chat_ids(conversations))


class _NoVAE:
    config = SimpleNamespace(latents_mean=[0.0], latents_std=[1.0], scale_factor_spatial=16, scale_factor_temporal=4)
    dtype = torch.float32


@pytest.fixture(scope="module")
def tok() -> ByteTokenizer:
    return ByteTokenizer(vocab_size=272)


@pytest.fixture(scope="module")
def pipeline(tok):
    return diffusers_pipeline.Cosmos3OmniPipeline(
        transformer=None, text_tokenizer=_HFStyleByteTokenizer(tok), vae=_NoVAE(), scheduler=None,
        enable_safety_checker=False,
    )


@pytest.mark.parametrize(
    "prompt, spec",
    [
        ("A robot arm stacks red cubes.", PromptSpec(num_frames=189, height=720, width=1280, fps=24.0)),
        ("a cat", PromptSpec(num_frames=1, height=64, width=96)),  # T2I: image system prompt, no duration
        ("ünïcode ✓", PromptSpec(num_frames=33, fps=16.0, use_system_prompt=False, add_resolution_template=False)),
    ],
)
def test_prompt_ids_match_diffusers_pipeline(pipeline, tok, prompt, spec):
    cond, uncond = pipeline.tokenize_prompt(
        prompt, None, num_frames=spec.num_frames, height=spec.height, width=spec.width, fps=spec.fps,
        use_system_prompt=spec.use_system_prompt, add_resolution_template=spec.add_resolution_template,
        add_duration_template=spec.add_duration_template,
    )
    assert build_generation_prompt(prompt, tok, spec) == cond
    assert build_generation_prompt("", tok, spec, negative=True) == uncond


def test_prompt_layout_and_specials(tok):
    ids = build_generation_prompt("hi", tok)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|im_end|><|vision_start|>"
    assert ids[-2:] == [tok.token_id("<|im_end|>"), tok.token_id("<|vision_start|>")]
    assert max(ids) < tok.vocab_size
    assert render_qwen_chat([{"role": "system", "content": "s"}]).startswith("<|im_start|>system\ns<|im_end|>\n")
    with pytest.raises(ValueError, match="role"):
        render_qwen_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(KeyError, match="unknown special token"):
        tok.token_id("<|nope|>")
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(vocab_size=100)
