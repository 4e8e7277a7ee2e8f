"""Explicit per-layer text K/V cache: a value object passed in and returned, never stored on the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KVPurpose = Literal["reasoner", "generator"]


@dataclass(frozen=True)
class TextKV:
    """Per-layer reasoner K/V of a text prefix.

    ``keys[i]`` / ``values[i]``: (B, num_key_value_heads, T, head_dim), keys already
    k-normed and rotated. Contiguous per layer so a paged allocator can later adopt
    the same (layer, kv_head, token, dim) addressing block-wise.

    ``purpose`` records which keys these are. They coincide for Nano/Super; on Edge
    (``use_und_k_norm_for_gen``) the generator sees the text keys through an extra
    k-norm, so a "reasoner" cache must not be fed to the generator and vice versa.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    purpose: KVPurpose = "reasoner"

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise ValueError(f"TextKV: {len(self.keys)} key layers but {len(self.values)} value layers")
        if not self.keys:
            raise ValueError("TextKV needs at least one layer")
        shape = self.keys[0].shape
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.ndim != 4 or k.shape != shape or v.shape != shape:
                raise ValueError(
                    f"TextKV layer {i}: keys {tuple(k.shape)} / values {tuple(v.shape)} must both be "
                    f"(B, kv_heads, T, head_dim) = {tuple(shape)}"
                )

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def length(self) -> int:
        """Number of cached text tokens."""
        return self.keys[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    def append(self, other: "TextKV") -> "TextKV":
        """A new cache with ``other``'s tokens after this cache's tokens."""
        if other.num_layers != self.num_layers or other.purpose != self.purpose:
            raise ValueError(
                f"TextKV.append: layers/purpose mismatch ({self.num_layers}, {self.purpose}) vs "
                f"({other.num_layers}, {other.purpose})"
            )
        return TextKV(
            keys=tuple(torch.cat([a, b], dim=2) for a, b in zip(self.keys, other.keys)),
            values=tuple(torch.cat([a, b], dim=2) for a, b in zip(self.values, other.values)),
            purpose=self.purpose,
        )

    def slice(self, start: int, end: int | None = None) -> "TextKV":
        """Tokens [start, end) of every layer (e.g. to roll back a rejected draft)."""
        end = self.length if end is None else end
        if not 0 <= start < end <= self.length:
            raise ValueError(f"TextKV.slice: need 0 <= start < end <= {self.length}, got [{start}, {end})")
        return TextKV(
            keys=tuple(k[:, :, start:end] for k in self.keys),
            values=tuple(v[:, :, start:end] for v in self.values),
            purpose=self.purpose,
        )

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "TextKV":
        return TextKV(
            keys=tuple(k.to(device=device, dtype=dtype) for k in self.keys),
            values=tuple(v.to(device=device, dtype=dtype) for v in self.values),
            purpose=self.purpose,
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
