"""Exact halo tiling of the Wan VAE decode (``WanVAE.decode(halo=HaloTiling(...))``, issue 36 §2).

- A halo-tiled decode equals the untiled decode within fp32 rounding (the tiles' convs see other shapes,
  so oneDNN may sum in another order), for Wan 2.1 and 2.2 decoders, several grids, eager and fused
  ops, frame chunks and batch slicing.
- The margins are what makes it exact: margins one pixel short at the last up stage, or none at all,
  change the video at the seams (negative controls).
- The decoder's reach is derived from its layers; for the released Wan 2.1 decoder it equals a count
  by hand.
- Only one tile's history and activations are alive at a time: the activation peak falls.
- Bad combinations are refused by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from fv_kernel.compute.fused import TorchFusedOps
from fv_wan.models import vae_blocks
from fv_wan.models.vae import HaloTiling, TilingConfig, WanVAE, WanVAEConfig
from tiny_vae_configs import CFG21, CFG22, seeded_vae

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _vae(cfg: WanVAEConfig) -> WanVAE:
    return seeded_vae(cfg)


def _latent(cfg: WanVAEConfig, batch: int = 1, frames: int = 3, height: int = 20, width: int = 24) -> torch.Tensor:
    return torch.randn(batch, cfg.z_dim, frames, height, width, generator=torch.Generator().manual_seed(3))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("cfg", [CFG21, CFG22], ids=["2.1", "2.2"])
@pytest.mark.parametrize("grid", [(1, 2), (2, 3), (3, 1)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_halo_tiles_decode_what_the_untiled_decode_does(cfg: WanVAEConfig, grid: tuple[int, int]) -> None:
    vae = _vae(cfg)
    z = _latent(cfg)
    halo = HaloTiling(rows=grid[0], columns=grid[1])
    with torch.no_grad():
        whole = vae.decode(z)
        assert _max_diff(vae.decode(z, halo=halo), whole) < 1e-5
        vae.set_fused_ops(TorchFusedOps())
        assert _max_diff(vae.decode(z, halo=halo), whole) < 1e-5


def test_halo_tiles_with_frame_chunks_and_batch_slicing() -> None:
    vae = _vae(CFG21)
    z = _latent(CFG21, batch=2, frames=4)
    halo = HaloTiling(rows=2, columns=2)
    with torch.no_grad():
        whole = vae.decode(z)
        vae.set_decode_frame_chunk(1)
        assert _max_diff(vae.decode(z, halo=halo), whole) < 1e-5
        assert _max_diff(vae.decode(z, halo=halo, slicing=True), whole) < 1e-5


def test_one_tile_is_the_untiled_decode_bit_for_bit() -> None:
    vae = _vae(CFG22)
    z = _latent(CFG22)
    with torch.no_grad():
        assert torch.equal(vae.decode(z, halo=HaloTiling()), vae.decode(z))


def _shortened(reaches_of: object) -> object:
    original = vae_blocks.Decoder3d.halo_geometry

    def geometry(self: vae_blocks.Decoder3d) -> tuple[list[int], list[int]]:
        scales, reaches = original(self)
        return scales, reaches_of(reaches)  # type: ignore[operator]

    return geometry


@pytest.mark.parametrize(
    "shorten",
    [lambda r: [*r[:3], r[3] - 1, r[4]], lambda r: [0] * len(r)],
    ids=["last-stage-one-short", "no-margins"],
)
def test_short_margins_change_the_seams(monkeypatch: pytest.MonkeyPatch, shorten: object) -> None:
    """Negative control: the margins, not luck, make the tiles exact."""
    vae = _vae(CFG21)
    z = _latent(CFG21)
    with torch.no_grad():
        whole = vae.decode(z)
        monkeypatch.setattr(vae_blocks.Decoder3d, "halo_geometry", _shortened(shorten))
        assert _max_diff(vae.decode(z, halo=HaloTiling(rows=2, columns=2)), whole) > 1e-3


def test_the_wan21_decoders_reach_matches_a_count_by_hand() -> None:
    """Counted from the released decoder (3 residual blocks a stage, two 3x3 convs each; 2x upsamplers
    with a 3x3 conv after the nearest upsampling; a 3x3 output conv), from the output backwards in
    each boundary's own pixels: before conv_out 1; stage 3 adds 6 -> 7; stage 2's upsampler gives
    ceil((7 + 1) / 2) = 4, its blocks 6 -> 10; stage 1: ceil(11 / 2) + 6 = 12; stage 0: ceil(13 / 2) + 6 = 13."""
    with torch.device("meta"):
        decoder = WanVAE(WanVAEConfig.wan21()).decoder
    assert decoder.halo_geometry() == ([1, 2, 4, 8, 8], [13, 12, 10, 7, 1])


def test_halo_tiles_lower_the_activation_peak() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from bench_vae_decode import activation_peak_bytes
    finally:
        sys.path.remove(str(BENCH))
    vae = _vae(CFG21)
    z = _latent(CFG21, frames=3, height=8, width=48)
    with torch.no_grad():
        whole = activation_peak_bytes(lambda: vae.decode(z))
        tiled = activation_peak_bytes(lambda: vae.decode(z, halo=HaloTiling(columns=3)))
    assert tiled < 0.7 * whole, (tiled, whole)


def test_bad_halo_requests_are_refused_by_name() -> None:
    vae = _vae(CFG21)
    z = _latent(CFG21, height=4, width=6)
    with pytest.raises(ValueError, match="tiling .* and halo .* exclude each other"):
        vae.decode(z, halo=HaloTiling(columns=2), tiling=TilingConfig())
    with pytest.raises(ValueError, match="needs at least one latent pixel per tile; the latents are 4 x 6"):
        vae.decode(z, halo=HaloTiling(rows=5))
    with pytest.raises(ValidationError, match="columns"):
        HaloTiling(columns=0)
    with pytest.raises(ValidationError, match="extra"):
        HaloTiling(cols=2)  # type: ignore[call-arg]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels on CUDA; the CPU tests run the torch reference ops")
def test_halo_tiles_on_cuda_with_the_triton_kernels() -> None:
    """The tiles' cropped views go through the Triton norm (strided reads) and bias kernels in bf16."""
    from fv_kernel.compute.fused import TritonFusedOps

    vae = seeded_vae(CFG21, torch.bfloat16, "cuda")
    vae.set_fused_ops(TritonFusedOps())
    z = _latent(CFG21, frames=4, height=24, width=40).to("cuda", torch.bfloat16)
    with torch.no_grad():
        whole = vae.decode(z).float()
        tiled = vae.decode(z, halo=HaloTiling(rows=2, columns=3)).float()
    # Other conv shapes sum in other orders: a few bf16 roundings of values in [-1, 1].
    assert (tiled - whole).abs().max().item() < 0.05


@pytest.mark.parametrize("cfg", [CFG21, CFG22], ids=["2.1", "2.2"])
def test_aligned_halo_tiles_stay_exact(cfg: WanVAEConfig) -> None:
    vae = _vae(cfg)
    z = _latent(cfg, height=12, width=40)
    with torch.no_grad():
        whole = vae.decode(z)
        for align in (1, 8, 16):
            assert _max_diff(vae.decode(z, halo=HaloTiling(rows=2, columns=3, align=align)), whole) < 1e-5, align


def test_align_widens_the_ranges_below_full_resolution_to_its_multiple() -> None:
    """At the released decoder's 480x832 latent (60x104), 1x2 tiles: the ranges before the 2x and 4x stages
    become multiples of 16 (116 -> 128, 218 -> 224 columns; 16 is the default); the full-resolution stage's is
    left alone."""
    with torch.device("meta"):
        vae = WanVAE(WanVAEConfig.wan21())

    def widths(align: int) -> list[int]:
        tile = vae.halo_tiles(60, 104, HaloTiling(columns=2, align=align))[1]
        left, right = tile.region[2:]
        out = [right - left]
        scales = vae.decoder.halo_geometry()[0]
        for b, crop in enumerate(tile.crops[1:-1], start=1):
            ratio = scales[b] // scales[b - 1]
            left, right = left * ratio + crop.left, right * ratio - crop.right
            out.append(right - left)
        return out

    assert widths(1) == [65, 116, 218, 423, 417]
    aligned = widths(16)
    assert HaloTiling().align == 16 and aligned == widths(HaloTiling().align)
    assert aligned[1] % 16 == 0 and aligned[2] % 16 == 0 and aligned[3:] == [423, 417]
