"""Offline UTF-8 byte-level tokenizer.

It stands in for the UMT5 SentencePiece tokenizer in the tiny card and the tests: no
download, deterministic, and it answers the subset of the Hugging Face tokenizer call
that ``WanPipeline._get_t5_prompt_embeds`` uses. Ids: pad 0, eos 1, unk 2, byte b -> b + 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

PaddingMode = Literal["max_length", "longest", "do_not_pad"]


@dataclass(frozen=True)
class TokenizerOutput:
    """``input_ids`` and ``attention_mask``: (B, L) long tensors, or lists of lists without tensors."""

    input_ids: Any
    attention_mask: Any | None

    def __getitem__(self, key: str) -> Any:  # BatchEncoding-style access
        if key not in ("input_ids", "attention_mask"):
            raise KeyError(key)
        return getattr(self, key)


class ByteTokenizer:
    """UTF-8 bytes as tokens, T5 conventions: eos appended, right padding, truncation keeps the eos."""

    pad_token_id = 0
    eos_token_id = 1
    unk_token_id = 2
    byte_offset = 3
    vocab_size = 256 + 3

    def __init__(self, model_max_length: int = 512) -> None:
        if model_max_length < 1:
            raise ValueError(f"model_max_length must be >= 1, got {model_max_length}")
        self.model_max_length = model_max_length

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [byte + self.byte_offset for byte in text.encode("utf-8")]
        return ids + [self.eos_token_id] if add_special_tokens else ids

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        data = bytearray()
        for token in values:
            if token >= self.byte_offset:
                data.append(token - self.byte_offset)
            elif not skip_special_tokens:
                data.extend({0: b"<pad>", 1: b"</s>", 2: b"<unk>"}.get(token, b"<unk>"))
        return data.decode("utf-8", errors="replace")

    def __call__(
        self,
        texts: str | Sequence[str],
        max_length: int | None = None,
        padding: bool | PaddingMode = "max_length",
        truncation: bool = True,
        add_special_tokens: bool = True,
        return_attention_mask: bool = True,
        return_tensors: Literal["pt"] | None = "pt",
    ) -> TokenizerOutput:
        batch = [texts] if isinstance(texts, str) else list(texts)
        if not all(isinstance(text, str) for text in batch):
            raise TypeError("texts must be a str or a sequence of str")
        mode = {True: "longest", False: "do_not_pad"}.get(padding, padding) if isinstance(padding, bool) else padding
        if mode not in ("max_length", "longest", "do_not_pad"):
            raise ValueError(
                f"padding must be one of 'max_length', 'longest', 'do_not_pad', True, False; got {padding!r}"
            )
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        limit = max_length if max_length is not None else self.model_max_length
        if limit < 1:
            raise ValueError(f"max_length must be >= 1, got {limit}")

        sequences = []
        for text in batch:
            ids = self.encode(text, add_special_tokens=False)
            if truncation:
                ids = ids[: limit - 1] if add_special_tokens else ids[:limit]
            sequences.append(ids + [self.eos_token_id] if add_special_tokens else ids)

        if mode == "max_length":
            width = max([limit, *(len(ids) for ids in sequences)])
        elif mode == "longest":
            width = max((len(ids) for ids in sequences), default=0)
        else:
            width = None
        if width is not None:
            masks = [[1] * len(ids) + [0] * (width - len(ids)) for ids in sequences]
            sequences = [ids + [self.pad_token_id] * (width - len(ids)) for ids in sequences]
        else:
            masks = [[1] * len(ids) for ids in sequences]

        if return_tensors == "pt":
            if len({len(ids) for ids in sequences}) > 1:
                raise ValueError("return_tensors='pt' needs equal lengths: use padding='max_length' or 'longest'")
            input_ids: Any = torch.tensor(sequences, dtype=torch.long)
            attention_mask: Any = torch.tensor(masks, dtype=torch.long)
        else:
            input_ids, attention_mask = sequences, masks
        return TokenizerOutput(input_ids=input_ids, attention_mask=attention_mask if return_attention_mask else None)
