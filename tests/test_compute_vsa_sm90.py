"""VSA's raster-layout block-sparse kernel compiled for an H100/H200 (sm_90) on the CPU, without a GPU:
Triton's compiler and the ptxas its wheel ships. At FastWan's bf16 shape, specialised as Triton's
JIT specialises a launch (16-byte aligned pointers, integer arguments divisible by 16 marked, unit
strides constant), it must compile, use Hopper's tensor-core instruction (wgmma), load q/k/v in
16-byte vectors (a row gather that fell back to 2-byte loads would be many times slower) and not
spill registers; the one-launch q/k/v tile means too (16-byte loads, no spills). What this cannot
say: how fast they run (``bench/bench_vsa.py``, on a GPU).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from fv_kernel.compute.fused import triton_available
from fv_kernel.testing.triton_checks import REQUIRE_KERNELS, compile_for_sm90

if not triton_available():
    if REQUIRE_KERNELS:
        pytest.fail("FV_REQUIRE_TRITON_KERNELS=1 but triton is not importable", pytrace=False)
    pytest.skip("needs triton", allow_module_level=True)

LENGTH, HEADS, DIM = 23_296, 12, 128  # 16x28x52 tokens: 364 tiles of 4x4x4
CONSTEXPRS = {"HAS_GATE": True, "TILE_T": 4, "TILE_H": 4, "TILE_W": 4, "BLOCK_M": 64, "BLOCK_D": 128, "PRECISION": "tf32"}


def compile_sm90(strides: dict[str, int], head_dim: int = DIM) -> dict[str, Any]:
    """PTX facts and ptxas's register report for the kernel specialised to (B, H, L, D) ``strides``."""
    from fv_kernel.compute.video_sparse_attention import _raster_kernels

    values: dict[str, Any] = {
        **{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "o_ptr")}, "c_ptr": "*fp32", "sel_ptr": "*i32",
        "scale_log2": "fp32", "heads": HEADS, "n_tiles": 364, "n_selected": 73, "head_dim": head_dim,
        "grid_t": 16, "grid_h": 28, "grid_w": 52, "tiles_h": 7, "tiles_w": 13,
    }
    for tensor in "qkvgo":
        values.update({f"s{tensor}_{axis}": stride for axis, stride in strides.items()})
    build = compile_for_sm90(_raster_kernels()[1], values, CONSTEXPRS, num_warps=4, num_stages=3)
    ptx = build.ptx
    return {
        "wgmma": ptx.count("wgmma.mma_async"),
        "wide_loads": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32|cp\.async\.cg\.shared\.global.*16;", ptx)),
        "narrow_loads": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.b16", ptx)),
        "spill_bytes": build.spill_bytes,
    }


@pytest.fixture(scope="module")
def contiguous() -> dict[str, Any]:
    return compile_sm90({"b": HEADS * LENGTH * DIM, "h": LENGTH * DIM, "l": DIM, "d": 1})


@pytest.mark.parametrize(
    "layout", ["contiguous (B, H, L, D)", "the model's (B, L, H, D) views"],
)
def test_the_fused_kernel_compiles_for_sm90_with_wgmma_wide_loads_and_no_spills(contiguous: dict[str, Any], layout: str) -> None:
    facts = contiguous if layout.startswith("contiguous") else compile_sm90(
        {"b": LENGTH * HEADS * DIM, "h": DIM, "l": HEADS * DIM, "d": 1}
    )
    assert facts["wgmma"] > 0, facts
    assert facts["wide_loads"] > 0 and facts["narrow_loads"] == 0, facts
    assert facts["spill_bytes"] == 0, facts


def test_negative_control_rows_not_16_byte_aligned_fall_back_to_narrow_loads(contiguous: dict[str, Any]) -> None:
    # head_dim 120: the row stride (120 elements) is not a multiple of 16, so Triton cannot prove
    # the gathered rows 16-byte aligned and loads them 2 bytes at a time.
    facts = compile_sm90({"b": HEADS * LENGTH * 120, "h": LENGTH * 120, "l": 120, "d": 1}, head_dim=120)
    assert facts["narrow_loads"] > 0, facts


def test_the_stacked_tile_means_compile_for_sm90_with_wide_loads_and_no_spills() -> None:
    from fv_kernel.compute.video_sparse_attention import _raster_kernels

    values: dict[str, Any] = {**{f"x{i}_ptr": "*bf16" for i in range(3)}, "out_ptr": "*fp32"}
    for i in range(3):  # the model's (B, L, H, D) views
        values.update({f"s{i}_b": LENGTH * HEADS * DIM, f"s{i}_h": DIM, f"s{i}_l": HEADS * DIM, f"s{i}_d": 1})
    values.update(heads=HEADS, n_tiles=364, head_dim=DIM, grid_t=16, grid_h=28, grid_w=52, tiles_h=7, tiles_w=13)
    constexprs = {"TILE_T": 4, "TILE_H": 4, "TILE_W": 4, "BLOCK_M": 64, "BLOCK_D": DIM}
    build = compile_for_sm90(_raster_kernels()[0], values, constexprs, num_warps=4, num_stages=3)
    assert re.search(r"ld\.global(?:\.[a-z]+)*\.v4", build.ptx), "no 16-byte loads"
    assert not re.search(r"ld\.global(?:\.[a-z]+)*\.b16", build.ptx), "2-byte loads"
    assert build.spill_bytes == 0
