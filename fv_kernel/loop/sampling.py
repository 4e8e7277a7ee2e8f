"""Seeded token sampling for AR decode loops: temperature, top-k, top-p, presence penalty.

Pure functions of (logits, params, generator); the generator's state lives in the
loop's state, so a decode is reproducible and resumable.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["apply_presence_penalty", "sample_next_token"]


def apply_presence_penalty(logits: torch.Tensor, seen: Iterable[int], penalty: float) -> torch.Tensor:
    """Subtract ``penalty`` from the logits of every token that already appeared (OpenAI/vLLM semantics)."""
    if penalty == 0.0:
        return logits
    ids = sorted(set(int(t) for t in seen))
    if not ids:
        return logits
    out = logits.clone()
    out[..., ids] -= penalty
    return out


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
) -> int:
    """One token id from 1-D ``logits``. Temperature 0 is greedy (argmax, no RNG draw)."""
    if logits.ndim != 1:
        raise ValueError(f"sample_next_token takes 1-D logits, got shape {tuple(logits.shape)}")
    logits = logits.float().cpu()
    if temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cumulative = torch.cumsum(probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = cumulative - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
