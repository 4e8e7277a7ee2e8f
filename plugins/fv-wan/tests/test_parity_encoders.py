"""C0 parity of fv_wan's text/image encoders against diffusers' Wan pipelines (CPU, fp32)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from PIL import Image
from transformers import CLIPImageProcessor

from fv_wan.models.encoders import ClipPreprocessor, WanImageEncoder, WanTextEncoder, clean_prompt
from fv_wan.models.tokenizer import ByteTokenizer

FP32_TOLERANCE = 1e-5

PROMPTS = [
    "  A cat &amp;amp; a dog\n\n baking   a cake  ",
    "Ünïcödé prompt — with «quotes» and a very long tail " * 3,
    "",
]


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), mode="RGB")


def test_clean_prompt_matches_diffusers() -> None:
    for text in [*PROMPTS, "x\x1cy\u00a0z", "caf\u00c3\u00a9 &lt;b&gt;"]:
        assert clean_prompt(text) == prompt_clean(text)


def test_byte_tokenizer_conventions() -> None:
    tokenizer = ByteTokenizer()
    out = tokenizer(["hi", "é"], max_length=5)
    assert out.input_ids.tolist() == [[ord("h") + 3, ord("i") + 3, 1, 0, 0], [0xC3 + 3, 0xA9 + 3, 1, 0, 0]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    truncated = tokenizer("abcdef", max_length=4)
    assert truncated.input_ids.tolist() == [[ord("a") + 3, ord("b") + 3, ord("c") + 3, 1]]  # eos kept
    assert tokenizer.decode(out.input_ids[1]) == "é"
    longest = tokenizer(["a", "abc"], padding="longest", return_tensors=None)
    assert longest["input_ids"] == [[ord("a") + 3, 1, 0, 0], [ord("a") + 3, ord("b") + 3, ord("c") + 3, 1]]
    with pytest.raises(ValueError, match="padding must be one of"):
        tokenizer("a", padding="left")


def test_text_encoder_matches_wan_pipeline_t5_embeds() -> None:
    encoder = WanTextEncoder.tiny(seed=0)
    assert encoder.model.config.vocab_size == ByteTokenizer.vocab_size
    # _get_t5_prompt_embeds only reads .text_encoder/.tokenizer (and the device we pass).
    pipeline_like = SimpleNamespace(text_encoder=encoder.model, tokenizer=encoder.tokenizer)
    expected = WanPipeline._get_t5_prompt_embeds(
        pipeline_like, prompt=PROMPTS, max_sequence_length=24, device=torch.device("cpu")
    )
    actual = encoder.encode(PROMPTS, max_sequence_length=24)
    assert actual.shape == (3, 24, 32)
    assert (actual - expected).abs().max().item() <= FP32_TOLERANCE
    # Rows past each prompt's real length are exactly zero; real rows are not.
    lengths = encoder.tokenizer([clean_prompt(p) for p in PROMPTS], max_length=24).attention_mask.sum(1)
    for row, length in zip(actual, lengths.tolist()):
        assert torch.all(row[length:] == 0) and torch.all(row[:length].abs().sum(-1) > 0)
    # UMT5 emits non-zero states at padded positions, so the cut-and-re-pad is what zeroes them.
    tokens = encoder.tokenizer([clean_prompt(PROMPTS[2])], max_length=24)
    raw = encoder.model(tokens.input_ids, tokens.attention_mask).last_hidden_state
    assert raw[0, lengths[2] :].abs().sum() > 0


def test_image_encoder_matches_i2v_pipeline_encode_image_with_clip_processor() -> None:
    tiny = WanImageEncoder.tiny(seed=0)
    processor = CLIPImageProcessor(size=32, crop_size=32)
    encoder = WanImageEncoder(tiny.model, processor)
    images = [_image(1, (48, 40)), _image(2, (40, 56))]
    pipeline_like = SimpleNamespace(image_encoder=encoder.model, image_processor=processor)
    expected = WanImageToVideoPipeline.encode_image(pipeline_like, images, device=torch.device("cpu"))
    actual = encoder.encode(images)
    assert actual.shape == (2, (32 // 8) ** 2 + 1, 16)
    assert (actual - expected).abs().max().item() <= FP32_TOLERANCE
    last = encoder.model(pixel_values=encoder.pixel_values(images), output_hidden_states=True).hidden_states[-1]
    assert (actual - last).abs().max().item() > 1e-3  # penultimate, not last


def test_builtin_clip_preprocessing_matches_clip_image_processor() -> None:
    processor = CLIPImageProcessor(size=32, crop_size=32)
    builtin = ClipPreprocessor(size=32, crop_size=32)
    for size in [(48, 40), (40, 56), (32, 32), (97, 61)]:
        image = _image(sum(size), size)
        expected = processor(images=image, return_tensors="pt").pixel_values
        assert (builtin(image) - expected).abs().max().item() <= FP32_TOLERANCE
    tiny = WanImageEncoder.tiny(seed=0)  # built-in path (no processor)
    with_processor = WanImageEncoder(tiny.model, processor)
    image = _image(3, (64, 48))
    assert (tiny.encode(image) - with_processor.encode(image)).abs().max().item() <= FP32_TOLERANCE
    with pytest.raises(TypeError, match="unsupported image type"):
        tiny.encode("not an image")  # type: ignore[arg-type]


def test_text_encoder_runs_over_the_longest_prompt_only_and_matches_the_full_padding() -> None:
    # Wan pads to 512 tokens; the encoder runs over the longest real prompt of the batch, and the
    # result still matches diffusers' full-length encode (the test above, and here at 512).
    encoder = WanTextEncoder.tiny(seed=0)
    seen: list[tuple[int, ...]] = []
    encoder.model.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    pipeline_like = SimpleNamespace(text_encoder=encoder.model, tokenizer=encoder.tokenizer)
    expected = WanPipeline._get_t5_prompt_embeds(pipeline_like, prompt=PROMPTS, max_sequence_length=512,
                                                 device=torch.device("cpu"))
    assert seen == [(3, 512)]
    actual = encoder.encode(PROMPTS, max_sequence_length=512)
    longest = int(encoder.tokenizer([clean_prompt(p) for p in PROMPTS], max_length=512).attention_mask.sum(1).max())
    assert seen[1] == (3, longest) and longest < 512
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= FP32_TOLERANCE


def test_text_encoder_keeps_the_full_width_when_padding_is_not_on_the_right() -> None:
    encoder = WanTextEncoder.tiny(seed=0)
    seen: list[tuple[int, ...]] = []
    encoder.model.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    ids = torch.tensor([[0, 0, 5, 6, 7, 1], [8, 9, 1, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])  # row 0 is left-padded
    encoder.embed_ids(ids, mask, 8)
    assert seen == [(2, 6)]  # trimming to 4 columns would cut row 0's real tokens
