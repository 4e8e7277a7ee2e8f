"""Video Sparse Attention (the ``vsa`` driver): the tile partition, the compression branch, the
content-dependent top-k, the sparse branch and the gated combine, checked against independent
torch computations at tiny sizes; the partition-based Triton path (``bench/bench_vsa.py``'s
baseline) against the torch reference, on CUDA or on CPU in Triton's interpreter (a fresh Python
with ``TRITON_INTERPRET=1``, as ``test_compute_fused.py`` does), with negative controls. The
raster-layout path the driver runs: ``test_compute_vsa_raster.py``. GPU speed is not measured here.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fv_kernel.card.spec import AttentionAssumption
from fv_kernel.compute.attention import AttentionShapeError
from fv_kernel.compute.video_sparse_attention import (
    VideoSparseAttention,
    block_sparse_attention_torch,
    select_tiles,
    selected_tile_count,
    tile_partition,
    tile_unpartition,
    vsa_forward,
    vsa_reference,
)
from fv_kernel.plugins.registry import kernel_registry
from fv_kernel.testing.triton_checks import run_kernel_checks

CUDA = torch.cuda.is_available()
GRID = (5, 6, 7)  # pads to 8x8x8: 8 tiles of 4x4x4, none full
TILE = (4, 4, 4)


def qkvg(grid: tuple[int, int, int] = GRID, batch: int = 2, heads: int = 2, dim: int = 16, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, math.prod(grid), dim, generator=gen) for _ in range(4)]


# --------------------------------------------------------------------------- tiles


def test_tile_partition_groups_3d_neighbourhoods_and_pads() -> None:
    t, h, w = GRID
    coords = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    x = coords.reshape(1, 1, -1, 3).float() + 1  # +1: padding (0) is told apart from token (0, 0, 0)
    tiled = tile_partition(x, GRID, TILE)
    assert tiled.tiles.shape == (1, 1, 8, 64, 3)
    assert int(tiled.valid.sum()) == t * h * w
    for index in range(8):  # tile (nt, nh, nw) in raster order holds exactly its 4x4x4 box's real tokens
        nt, nh, nw = index // 4, (index // 2) % 2, index % 2
        real = tiled.tiles[0, 0, index][tiled.valid[index]] - 1
        lo = torch.tensor([4 * nt, 4 * nh, 4 * nw])
        assert ((real >= lo) & (real < lo + 4)).all()
        box = [min(4, g - 4 * n) for g, n in zip(GRID, (nt, nh, nw))]
        assert len(real) == math.prod(box)
        assert (tiled.tiles[0, 0, index][~tiled.valid[index]] == 0).all()
    assert torch.equal(tile_unpartition(tiled.tiles, GRID, TILE), x)


def test_tile_partition_refuses_a_grid_that_is_not_the_sequence() -> None:
    with pytest.raises(AttentionShapeError, match="token grid"):
        tile_partition(torch.zeros(1, 1, 10, 4), (2, 2, 2), TILE)


def test_selected_tile_count_is_ceil_of_the_kept_fraction() -> None:
    assert selected_tile_count(364, 0.8) == 73  # 448x832x61 -> 16x28x52 tokens: 364 tiles
    assert selected_tile_count(364, 0.9) == 37
    assert selected_tile_count(8, 0.0) == 8 and selected_tile_count(8, 0.99) == 1


# --------------------------------------------------------------------------- branches


def test_compression_and_selection_against_an_explicit_computation() -> None:
    q, k, v, _ = qkvg()
    scale = 16**-0.5
    tq, tk, tv = (tile_partition(t, GRID, TILE) for t in (q, k, v))
    compressed, selected = select_tiles(tq, tk, tv, 0.75, scale)
    # Explicit: each tile's mean over its real tokens, dense attention over tiles, top-2 of 8.
    means = [torch.stack([t.tiles[:, :, n][:, :, t.valid[n]].mean(2) for n in range(8)], 2) for t in (tq, tk, tv)]
    scores = means[0] @ means[1].transpose(-1, -2) * scale
    torch.testing.assert_close(compressed, torch.softmax(scores, -1) @ means[2])
    assert selected.shape == (2, 2, 8, 2)
    assert torch.equal(selected, scores.topk(2, -1).indices)


def test_selection_is_content_dependent() -> None:
    q, k, v, _ = qkvg()
    tq, tk, tv = (tile_partition(t, GRID, TILE) for t in (q, k, v))
    _, selected = select_tiles(tq, tk, tv, 0.75, 0.25)
    k2 = k.clone()
    k2[:, :, : 4 * 6 * 7] *= -1  # other keys -> other tiles win
    _, selected2 = select_tiles(tq, tile_partition(k2, GRID, TILE), tv, 0.75, 0.25)
    assert not torch.equal(selected, selected2)


def _explicit_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor, scale: float) -> torch.Tensor:
    """Loop form of the sparse branch: per (b, h, query tile), softmax over the gathered real keys."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                keys = torch.cat([k[b, h, j][valid[j]] for j in selected[b, h, i].tolist()])
                values = torch.cat([v[b, h, j][valid[j]] for j in selected[b, h, i].tolist()])
                out[b, h, i] = torch.softmax(q[b, h, i] @ keys.T * scale, -1) @ values
    return out


def test_masked_sparse_branch_equals_the_gathered_loop() -> None:
    q, k, v, _ = qkvg()
    tq, tk, tv = (tile_partition(t, GRID, TILE) for t in (q, k, v))
    _, selected = select_tiles(tq, tk, tv, 0.6, 0.25)
    got = block_sparse_attention_torch(tq.tiles, tk.tiles, tv.tiles, tq.valid, selected, 0.25)
    want = _explicit_sparse(tq.tiles, tk.tiles, tv.tiles, tq.valid, selected, 0.25)
    real = tq.valid[None, None, :, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real])


def test_all_tiles_and_no_gate_weight_is_dense_attention() -> None:
    q, k, v, gate = qkvg()
    dense = F.scaled_dot_product_attention(q, k, v)
    out = vsa_reference(q, k, v, grid=GRID, gate=torch.zeros_like(gate), sparsity=0.0, tile=TILE)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    # Negative control: at sparsity 0.8 the sparse branch alone is not dense attention.
    sparse = vsa_reference(q, k, v, grid=GRID, gate=torch.zeros_like(gate), sparsity=0.8, tile=TILE)
    assert (sparse - dense).abs().max() > 1e-2


def test_gated_combine_adds_the_broadcast_compressed_output_times_the_gate() -> None:
    q, k, v, gate = qkvg()
    sparse_only = vsa_reference(q, k, v, grid=GRID, gate=torch.zeros_like(gate), sparsity=0.75, tile=TILE)
    gated = vsa_reference(q, k, v, grid=GRID, gate=gate, sparsity=0.75, tile=TILE)
    tq, tk, tv = (tile_partition(t, GRID, TILE) for t in (q, k, v))
    compressed, _ = select_tiles(tq, tk, tv, 0.75, 0.25)
    per_token = tile_unpartition(compressed[:, :, :, None].expand(-1, -1, -1, 64, -1), GRID, TILE)
    torch.testing.assert_close(gated - sparse_only, per_token * gate, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- driver


def test_vsa_is_a_registered_driver_configured_by_the_recipe() -> None:
    driver = kernel_registry().attention_backend("vsa")
    assert isinstance(driver, VideoSparseAttention) and driver.needs_video_grid
    configured = driver.for_assumption(AttentionAssumption(kind="vsa", sparsity=0.9, tile=(2, 4, 4)))
    assert (configured.sparsity, configured.tile) == (0.9, (2, 4, 4))
    q, k, v, gate = qkvg()
    torch.testing.assert_close(
        VideoSparseAttention(0.75, TILE, "torch").attend_video(q, k, v, grid=GRID, gate=gate),
        vsa_reference(q, k, v, grid=GRID, gate=gate, sparsity=0.75, tile=TILE),
    )
    # Without a grid (cross-attention to text) it is plain dense attention.
    text_k, text_v = k[:, :, :7], v[:, :, :7]
    torch.testing.assert_close(driver.attend(q, text_k, text_v), F.scaled_dot_product_attention(q, text_k, text_v))


def test_vsa_refuses_mismatched_shapes() -> None:
    q, k, v, gate = qkvg()
    with pytest.raises(AttentionShapeError, match="self-attention"):
        vsa_reference(q, k[:, :, :10], v[:, :, :10], grid=GRID, gate=gate, sparsity=0.8, tile=TILE)
    with pytest.raises(AttentionShapeError, match="gate"):
        vsa_reference(q, k, v, grid=GRID, gate=gate[:, :1], sparsity=0.8, tile=TILE)
    with pytest.raises(ValueError, match="sparsity"):
        VideoSparseAttention(sparsity=1.0)


# --------------------------------------------------------------------------- Triton kernel


def _wrong_tile_mapping(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Tiles cut from the flat sequence in runs of 64 tokens (no 3-D neighbourhoods): the bug."""
    length = q.shape[2]
    flat = (1, 1, length)
    return vsa_forward(q, k, v, grid=flat, gate=gate, sparsity=0.75, tile=(1, 1, 64))


def kernel_checks(device: str) -> dict[str, Any]:
    """Max |Triton - reference| per case, and the negative controls' errors."""
    from fv_kernel.compute.video_sparse_attention import (
        block_sparse_attention_triton,
        tile_means_torch,
        tile_means_triton,
        triton_interpreted,
    )

    out: dict[str, Any] = {"interpreted": triton_interpreted()}
    for name, grid, tile, sparsity in (
        ("padded_4x4x4", GRID, TILE, 0.75), ("exact_4x4x4", (4, 8, 8), TILE, 0.8),
        ("dense_limit", GRID, TILE, 0.0), ("odd_tile", (3, 5, 6), (2, 2, 4), 0.6),
    ):
        q, k, v, gate = (t.to(device) for t in qkvg(grid))
        ref = vsa_reference(q, k, v, grid=grid, gate=gate, sparsity=sparsity, tile=tile)
        tri = vsa_forward(
            q, k, v, grid=grid, gate=gate, sparsity=sparsity, tile=tile, sparse_branch=block_sparse_attention_triton,
            pool=tile_means_triton,
        )
        out[name] = float((ref - tri).abs().max())
        tiled = tile_partition(k, grid, tile)
        out[f"pool:{name}"] = float((tile_means_triton(tiled) - tile_means_torch(tiled)).abs().max())
    # Negative control: pooling that counts the padding as tokens (a mean over all 64) differs.
    q, k, v, gate = (t.to(device) for t in qkvg())
    tiled = tile_partition(k, GRID, TILE)
    padded_mean = tiled.tiles.float().mean(3)
    out["pool_counting_padding"] = float((tile_means_triton(tiled) - padded_mean).abs().max())
    q, k, v, gate = (t.to(device) for t in qkvg())
    tri = vsa_forward(q, k, v, grid=GRID, gate=gate, sparsity=0.75, tile=TILE, sparse_branch=block_sparse_attention_triton)
    out["wrong_tile_mapping"] = float((_wrong_tile_mapping(q, k, v, gate) - tri).abs().max())

    def shifted(qt, kt, vt, valid, selected, scale):  # the kernel reading the next tile over
        return block_sparse_attention_triton(qt, kt, vt, valid, (selected + 1) % qt.shape[2], scale)

    bad = vsa_forward(q, k, v, grid=GRID, gate=gate, sparsity=0.75, tile=TILE, sparse_branch=shifted)
    ref = vsa_reference(q, k, v, grid=GRID, gate=gate, sparsity=0.75, tile=TILE)
    out["shifted_selection"] = float((bad - ref).abs().max())
    return out


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
    results = run_kernel_checks(__file__, lambda: kernel_checks("cuda"), what="the VSA kernel")
    assert CUDA or results["interpreted"], "TRITON_INTERPRET=1 was set but Triton compiled the kernel for a GPU"
    return results


@pytest.mark.parametrize("case", ["padded_4x4x4", "exact_4x4x4", "dense_limit", "odd_tile"])
def test_triton_block_sparse_kernel_matches_the_reference(kernels: dict[str, Any], case: str) -> None:
    assert kernels[case] < 1e-5, kernels


@pytest.mark.parametrize("case", ["padded_4x4x4", "exact_4x4x4", "dense_limit", "odd_tile"])
def test_triton_tile_means_match_the_reference(kernels: dict[str, Any], case: str) -> None:
    assert kernels[f"pool:{case}"] < 1e-5, kernels


def test_negative_control_pooling_over_padding_fails_the_comparison(kernels: dict[str, Any]) -> None:
    assert kernels["pool_counting_padding"] > 1e-2, kernels


def test_negative_control_a_wrong_tile_mapping_fails_the_comparison(kernels: dict[str, Any]) -> None:
    assert kernels["wrong_tile_mapping"] > 1e-2, kernels


def test_negative_control_a_kernel_reading_the_wrong_tiles_fails_the_comparison(kernels: dict[str, Any]) -> None:
    assert kernels["shifted_selection"] > 1e-2, kernels


if __name__ == "__main__":  # the interpreter run (see the module docstring)
    print(json.dumps(kernel_checks("cuda" if CUDA else "cpu")))
