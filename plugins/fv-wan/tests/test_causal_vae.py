"""Streaming VAE decode of a causal card: chunk by chunk with the causal feature cache equals one whole decode."""

from __future__ import annotations

import pytest
import torch

from fv_wan.cards import TINY_VAE21
from fv_wan.models.vae import WanVAE

from test_causal_parity import tiny_instance


def _vae() -> WanVAE:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = WanVAE(TINY_VAE21).eval()
    return vae


def _latents(frames: int = 9) -> torch.Tensor:
    return torch.randn((1, TINY_VAE21.z_dim, frames, 4, 6), generator=torch.Generator().manual_seed(5))


def _chunks(z: torch.Tensor, size: int = 3) -> list[torch.Tensor]:
    return [z[:, :, i : i + size] for i in range(0, z.shape[2], size)]


@torch.no_grad()
def test_chunked_decode_equals_whole_decode() -> None:
    vae, z = _vae(), _latents()
    whole = vae.decode(z)
    cache = vae.new_decode_cache()
    parts = []
    for chunk in _chunks(z):
        frames, cache = vae.decode_chunk(chunk, cache)
        parts.append(frames)
    assert [p.shape[2] for p in parts] == [9, 12, 12]  # 1 + 4*2 for the first chunk, then 4 per latent frame
    assert (torch.cat(parts, dim=2) - whole).abs().max() <= 1e-6


@torch.no_grad()
def test_negative_control_cache_reset_between_chunks_differs() -> None:
    vae, z = _vae(), _latents()
    whole = vae.decode(z)
    chunks = _chunks(z)
    first, _ = vae.decode_chunk(chunks[0], vae.new_decode_cache())
    second, _ = vae.decode_chunk(chunks[1], vae.new_decode_cache())  # the bug: a fresh cache per chunk
    assert second.shape[2] != 12 or (second - whole[:, :, 9:21]).abs().max() > 1e-3
    # Same frame count with the history replaced by zeros (first-frame handling off) still differs.
    cache = vae.new_decode_cache()
    vae.decode_chunk(chunks[0], cache)
    for slots in cache.tiles:
        for i, value in enumerate(slots):
            if value is not None:
                slots[i] = torch.zeros_like(value)
    stale, _ = vae.decode_chunk(chunks[1], cache)
    assert (stale - whole[:, :, 9:21]).abs().max() > 1e-3


def test_decode_chunk_refuses_an_empty_chunk() -> None:
    vae = _vae()
    with pytest.raises(ValueError, match="at least one latent frame"):
        vae.decode_chunk(torch.zeros((1, TINY_VAE21.z_dim, 0, 4, 4)), vae.new_decode_cache())


@torch.no_grad()
def test_decode_op_carries_the_cache_through_the_state() -> None:
    """The card's ``vae_decode_chunk`` op: the cache goes out as tensors (kept in the loop state) and comes back."""
    instance = tiny_instance()
    vae = instance.component("vae_decoder")
    decode = instance.op("vae_decode_chunk").fn
    z = torch.randn((1, 16, 9, 4, 4), generator=torch.Generator().manual_seed(2))
    carried: dict[str, torch.Tensor] = {}
    frames = []
    for chunk in _chunks(z):
        out = decode({"z": chunk, **{f"cache.{k}": v for k, v in carried.items()}}, {})
        carried = {k[len("cache."):]: v for k, v in out.items() if k.startswith("cache.")}
        frames.append(out["frames"])
    whole = (vae.decode(vae.denormalize_latents(z)).float() / 2 + 0.5).clamp(0, 1)
    assert (torch.cat(frames, dim=2) - whole).abs().max() <= 1e-6
