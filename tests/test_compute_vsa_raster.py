"""VSA's raster-layout Triton path (:func:`vsa_triton`, what the ``vsa`` driver runs on Triton):
tile means and the block-sparse attention with the fused gated combine, reading q/k/v/gate in their
(B, H, L, D) layout of the (T, H, W) grid by index arithmetic, with no padded or permuted copies.
Checked against the dense masked torch reference (:func:`vsa_reference`) at tiny sizes, on CUDA or
on CPU in Triton's interpreter (a fresh Python with ``TRITON_INTERPRET=1``), including grids that
are not whole tiles, gate=None and the (B, L, H, D)-transposed layout the Wan model passes, with
negative controls. GPU speed is not measured here (``bench/bench_vsa.py``).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from fv_kernel.compute.attention import AttentionShapeError
from fv_kernel.compute.video_sparse_attention import VideoSparseAttention, vsa_reference
from fv_kernel.testing.triton_checks import run_kernel_checks

CUDA = torch.cuda.is_available()

#: name -> (grid, tile, sparsity, gated). Only "exact" is whole tiles; the rest pad edge tiles.
CASES: dict[str, tuple[tuple[int, int, int], tuple[int, int, int], float, bool]] = {
    "padded_4x4x4": ((5, 6, 7), (4, 4, 4), 0.75, True),
    "padded_2x2x2_no_gate": ((3, 3, 5), (2, 2, 2), 0.6, False),
    "odd_tile": ((3, 5, 6), (2, 2, 4), 0.75, True),
    "exact_4x4x4": ((4, 8, 8), (4, 4, 4), 0.5, True),
    "dense_limit": ((3, 5, 6), (4, 4, 4), 0.0, True),
    "head_dim_32": ((5, 6, 7), (4, 4, 4), 0.75, True),
}


def qkvg(grid: tuple[int, int, int], dim: int = 16, batch: int = 2, heads: int = 2, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, math.prod(grid), dim, generator=gen) for _ in range(4)]


def kernel_checks(device: str) -> dict[str, Any]:
    """Max |raster Triton - reference| per case, layout facts, and the negative controls' errors."""
    from fv_kernel.compute.video_sparse_attention import (
        _attend_tiles,
        block_sparse_attention_raster,
        tile_means_raster,
        tile_means_raster_stacked,
        tile_means_torch,
        tile_partition,
        triton_interpreted,
        vsa_triton,
    )

    out: dict[str, Any] = {"interpreted": triton_interpreted()}
    for name, (grid, tile, sparsity, gated) in CASES.items():
        q, k, v, gate = (t.to(device) for t in qkvg(grid, dim=32 if name == "head_dim_32" else 16))
        gate = gate if gated else None
        ref = vsa_reference(q, k, v, grid=grid, gate=gate, sparsity=sparsity, tile=tile)
        out[name] = float((vsa_triton(q, k, v, grid=grid, gate=gate, sparsity=sparsity, tile=tile) - ref).abs().max())
        out[f"pool:{name}"] = float(
            (tile_means_raster(k, grid, tile) - tile_means_torch(tile_partition(k, grid, tile))).abs().max()
        )

    grid, tile = (5, 6, 7), (4, 4, 4)
    q, k, v, gate = (t.to(device) for t in qkvg(grid))
    ref = vsa_reference(q, k, v, grid=grid, gate=gate, sparsity=0.75, tile=tile)
    # The Wan model's layout: (B, L, H, D) activations transposed to (B, H, L, D) views, not copied.
    bl = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, gate)]
    got = vsa_triton(*bl[:3], grid=grid, gate=bl[3], sparsity=0.75, tile=tile)
    out["strided"] = float((got - ref).abs().max())
    out["strided_output_keeps_layout"] = got.stride() == bl[0].stride()
    # 16-bit inputs (fp16: the interpreter's bf16 dot is unreliable; on CUDA this is the bf16 path's dtype handling).
    half = vsa_triton(*(t.half() for t in (q, k, v)), grid=grid, gate=gate.half(), sparsity=0.75, tile=tile)
    out["fp16_dtype"] = str(half.dtype)
    out["fp16"] = float((half.float() - ref).abs().max())
    # The driver on Triton end to end (what CUDA runs).
    driver = VideoSparseAttention(0.75, tile, "triton")
    out["driver_triton"] = float((driver.attend_video(q, k, v, grid=grid, gate=gate) - ref).abs().max())

    # q, k and v pooled in one launch equal three separate poolings.
    trio = [t.to(device) for t in qkvg(grid)[:3]]
    stacked = tile_means_raster_stacked(trio, grid, tile)
    out["stacked_pool"] = max(float((stacked[i] - tile_means_raster(t, grid, tile)).abs().max()) for i, t in enumerate(trio))

    # Negative controls. A wrong index mapping: the kernels told the grid is (T, W, H), so they read
    # h as w (tiles cut across the wrong axes) on data laid out (T, H, W).
    t_, h_, w_ = grid
    swapped = vsa_triton(q, k, v, grid=(t_, w_, h_), gate=gate, sparsity=0.75, tile=tile)
    out["swapped_h_w"] = float((swapped - ref).abs().max())
    # Pooling that counts an edge tile's padding as tokens (the mean over all 64 slots) differs.
    out["pool_counting_padding"] = float(
        (tile_means_raster(k, grid, tile) - tile_partition(k, grid, tile).tiles.float().mean(3)).abs().max()
    )
    # The sparse kernel reading the next tile over.
    compressed, selected = _attend_tiles(*(tile_means_raster(x, grid, tile) for x in (q, k, v)), 0.75, 16**-0.5)
    shifted = block_sparse_attention_raster(
        q, k, v, grid=grid, tile=tile, selected=(selected + 1) % selected.shape[2], compressed=compressed,
        gate=gate, scale=16**-0.5,
    )
    out["shifted_selection"] = float((shifted - ref).abs().max())
    # The combine without the gate (weight 1 where the model has a gate).
    ungated = vsa_triton(q, k, v, grid=grid, gate=None, sparsity=0.75, tile=tile)
    out["gate_dropped"] = float((ungated - ref).abs().max())
    try:
        vsa_triton(q, k, v[:, :, :-1], grid=grid, gate=gate, sparsity=0.75, tile=tile)
        out["short_v_refused"] = ""
    except AttentionShapeError as exc:
        out["short_v_refused"] = str(exc)
    try:
        vsa_triton(q, k.half(), v, grid=grid, gate=gate, sparsity=0.75, tile=tile)
        out["mixed_dtype_refused"] = ""
    except AttentionShapeError as exc:
        out["mixed_dtype_refused"] = str(exc)
    try:
        tile_means_raster(k, (5, 6, 8), tile)
        out["wrong_grid_refused"] = ""
    except AttentionShapeError as exc:
        out["wrong_grid_refused"] = str(exc)
    return out


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
    results = run_kernel_checks(__file__, lambda: kernel_checks("cuda"), what="the VSA raster kernels")
    assert CUDA or results["interpreted"], "TRITON_INTERPRET=1 was set but Triton compiled the kernel for a GPU"
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_raster_vsa_matches_the_reference(kernels: dict[str, Any], case: str) -> None:
    assert kernels[case] < 1e-5, kernels


@pytest.mark.parametrize("case", list(CASES))
def test_raster_tile_means_match_the_partitioned_means(kernels: dict[str, Any], case: str) -> None:
    assert kernels[f"pool:{case}"] < 1e-5, kernels


def test_q_k_and_v_pooled_in_one_launch_equal_separate_poolings(kernels: dict[str, Any]) -> None:
    assert kernels["stacked_pool"] == 0.0, kernels


def test_raster_vsa_reads_and_writes_the_transposed_model_layout(kernels: dict[str, Any]) -> None:
    assert kernels["strided"] < 1e-5, kernels
    assert kernels["strided_output_keeps_layout"], kernels


def test_raster_vsa_writes_16_bit_inputs_in_their_dtype(kernels: dict[str, Any]) -> None:
    assert kernels["fp16_dtype"] == "torch.float16", kernels
    assert kernels["fp16"] < 1e-2, kernels


def test_the_triton_driver_runs_the_raster_path(kernels: dict[str, Any]) -> None:
    assert kernels["driver_triton"] < 1e-5, kernels


def test_negative_control_swapped_h_and_w_fails_the_comparison(kernels: dict[str, Any]) -> None:
    assert kernels["swapped_h_w"] > 1e-2, kernels


def test_negative_control_pooling_over_padding_fails_the_comparison(kernels: dict[str, Any]) -> None:
    assert kernels["pool_counting_padding"] > 1e-2, kernels


def test_negative_control_reading_the_wrong_tiles_fails_the_comparison(kernels: dict[str, Any]) -> None:
    assert kernels["shifted_selection"] > 1e-2, kernels


def test_negative_control_dropping_the_gate_fails_the_comparison(kernels: dict[str, Any]) -> None:
    assert kernels["gate_dropped"] > 1e-2, kernels


def test_raster_vsa_refuses_mismatched_inputs(kernels: dict[str, Any]) -> None:
    assert "differ in batch/heads/seq" in kernels["short_v_refused"], kernels
    assert "token grid [5, 6, 8]" in kernels["wrong_grid_refused"], kernels
    assert "must share a dtype" in kernels["mixed_dtype_refused"], kernels


def test_a_bad_launch_configuration_is_refused_by_name() -> None:
    from fv_kernel.compute.video_sparse_attention import block_sparse_attention_raster

    q = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="num_warps"):
        block_sparse_attention_raster(
            q, q, q, grid=(2, 2, 2), tile=(2, 2, 2), selected=torch.zeros(1, 1, 1, 1, dtype=torch.long),
            compressed=torch.zeros(1, 1, 1, 16), gate=None, scale=0.25, num_warps=3,
        )


if __name__ == "__main__":  # the interpreter run (see the module docstring)
    print(json.dumps(kernel_checks("cuda" if CUDA else "cpu")))
