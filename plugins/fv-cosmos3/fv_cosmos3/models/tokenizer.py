"""Prompt tokenization for Cosmos 3 generation.

``ByteTokenizer`` is an offline byte-level tokenizer for tiny test cards (ids 0-255
are raw UTF-8 bytes, then the Qwen special tokens the template needs).
``build_generation_prompt`` reproduces the diffusers pipeline's ``tokenize_prompt``:
metadata templates, the Qwen3-VL chat template with the generation prompt, then
``eos`` (``<|im_end|>``) and ``<|vision_start|>`` appended; no padding. Real
checkpoints use the HF tokenizer through ``HFChatTokenizer`` with the same template.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
)
BYTE_VOCAB = 256


class ChatTokenizer(Protocol):
    """What ``build_generation_prompt`` needs from a tokenizer."""

    @property
    def eos_token_id(self) -> int: ...

    def token_id(self, token: str) -> int: ...

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the chat template applied with ``add_generation_prompt=True``."""
        ...


class ByteTokenizer:
    """Offline byte-level tokenizer: 256 byte ids, then ``SPECIAL_TOKENS``.

    ``vocab_size`` may exceed the used ids (the tiny card pads to 272); the model's
    embedding just has unused rows.
    """

    def __init__(self, vocab_size: int = 272) -> None:
        if vocab_size < BYTE_VOCAB + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must be >= {BYTE_VOCAB + len(SPECIAL_TOKENS)}, got {vocab_size}")
        self.vocab_size = vocab_size
        self._special_to_id = {tok: BYTE_VOCAB + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._id_to_special = {i: tok for tok, i in self._special_to_id.items()}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    @property
    def eos_token_id(self) -> int:
        # Qwen3-VL instruct tokenizers use <|im_end|> as eos.
        return self._special_to_id["<|im_end|>"]

    def token_id(self, token: str) -> int:
        if token not in self._special_to_id:
            raise KeyError(f"unknown special token {token!r}; known: {list(SPECIAL_TOKENS)}")
        return self._special_to_id[token]

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes, with special-token strings mapped to their single ids."""
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self._special_to_id:
                ids.append(self._special_to_id[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        buffer = bytearray()
        for i in ids:
            if i < BYTE_VOCAB:
                buffer.append(i)
                continue
            out.append(buffer.decode("utf-8", errors="replace"))
            buffer.clear()
            out.append(self._id_to_special.get(i, ""))
        out.append(buffer.decode("utf-8", errors="replace"))
        return "".join(out)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(render_qwen_chat(messages))


class HFChatTokenizer:
    """Adapter for a Hugging Face tokenizer (real checkpoints): its own chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @property
    def eos_token_id(self) -> int:
        return int(self._tok.eos_token_id)

    def token_id(self, token: str) -> int:
        return int(self._tok.convert_tokens_to_ids(token))

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        encoded = self._tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, add_vision_id=False, return_dict=True
        )
        return list(encoded["input_ids"])


def render_qwen_chat(messages: list[dict[str, str]]) -> str:
    """The Qwen3-VL chat template for plain-text messages, with the generation prompt."""
    parts = []
    for message in messages:
        role = message["role"]
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"message role must be one of ['assistant', 'system', 'user'], got {role!r}")
        parts.append(f"<|im_start|>{role}\n{message['content']}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class PromptSpec(BaseModel):
    """The request metadata the pipeline folds into the prompt text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_frames: int = 189
    height: int = 720
    width: int = 1280
    fps: float = 24.0
    use_system_prompt: bool = True
    add_resolution_template: bool = True
    add_duration_template: bool = True


def _append_sentence(base: str, addition: str) -> str:
    base = base.rstrip(".")
    return f"{base}. {addition}" if base else addition


def augment_prompt(text: str, spec: PromptSpec, *, negative: bool = False) -> str:
    """Append the duration / resolution sentences (inverse ones for the negative prompt)."""
    is_image = spec.num_frames == 1
    if not is_image and spec.add_duration_template:
        template = (
            "The video is not {duration:.1f} seconds long and is not of {fps:.0f} FPS."
            if negative
            else "The video is {duration:.1f} seconds long and is of {fps:.0f} FPS."
        )
        text = _append_sentence(text, template.format(duration=spec.num_frames / spec.fps, fps=spec.fps))
    if spec.add_resolution_template:
        kind = "image" if is_image else "video"
        template = f"This {kind} is not of {{height}}x{{width}} resolution." if negative else (
            f"This {kind} is of {{height}}x{{width}} resolution."
        )
        text = _append_sentence(text, template.format(height=spec.height, width=spec.width))
    return text


def build_generation_prompt(
    text: str,
    tokenizer: ChatTokenizer,
    spec: PromptSpec | None = None,
    *,
    negative: bool = False,
) -> list[int]:
    """Token ids of a generation prompt, exactly as the diffusers pipeline builds them.

    ``spec=None`` applies no metadata templates (the raw text goes into the chat).
    """
    messages: list[dict[str, str]] = []
    if spec is not None:
        text = augment_prompt(text, spec, negative=negative)
        if spec.use_system_prompt:
            system = SYSTEM_PROMPT_IMAGE if spec.num_frames == 1 else SYSTEM_PROMPT_VIDEO
            messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": text})
    return tokenizer.chat_ids(messages) + [tokenizer.eos_token_id, tokenizer.token_id("<|vision_start|>")]
