"""The FP8 Triton kernels (linear and attention) against dequantize-then-fp32 references written here.

The references share nothing with fv_kernel.compute.fp8 / fp8_attention: each dequantizes the
kernel's own inputs (the e4m3 weight times its per-output-channel scale; the activation quantized
per row by the code below) and multiplies in fp64. Negative controls show the comparison catches a
scale applied along the wrong axis and a dropped scale. On CPU the kernels run in Triton's
interpreter in a fresh Python (see fv_kernel.testing.triton_checks); on CUDA they run compiled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fv_kernel.compute.fused import triton_available
from fv_kernel.testing.triton_checks import REQUIRE_KERNELS, run_kernel_checks

CUDA = torch.cuda.is_available()
E4M3 = torch.float8_e4m3fn
TOL = 1e-4  # relative Frobenius error: the kernel and the reference round identically, they differ in summation order


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0 if a.shape == b.shape else float("inf")
    if a.shape != b.shape or not torch.isfinite(a).all():
        return float("inf")
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _ref_rows_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Per-row (token) quantize-dequantize: absmax/448 scales, round to nearest e4m3."""
    s = (x.double().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x.double() / s).clamp(-448, 448).float().to(E4M3).double() * s


def _ref_linear(x, w_e4m3, w_scale, bias, mode, *, scale_axis: str = "out", drop_scale: bool = False):  # type: ignore[no-untyped-def]
    """``x · dequant(W)ᵀ + b`` in fp64; ``scale_axis="in"`` / ``drop_scale`` are the broken references."""
    w = w_e4m3.double()
    s = w_scale.double().reshape(-1)
    if not drop_scale:
        w = w * (s[:, None] if scale_axis == "out" else s[None, :])
    xd = _ref_rows_e4m3(x) if mode == "fp8_dynamic" else x.double()
    y = xd @ w.t()
    return y if bias is None else y + bias.double()


def _quantized_weight(out_f: int, in_f: int, g: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight with per-output-channel scales of very different sizes (so a wrong axis shows)."""
    w = torch.randn(out_f, in_f, generator=g) * torch.logspace(-2, 1, out_f)[:, None]
    s = w.abs().amax(dim=1) / 448.0
    return (w / s[:, None]).to(E4M3).to(device), s.to(device)


def linear_errors(device: str, reference: Callable[..., torch.Tensor] = _ref_linear, *, kernel_scale: str = "right") -> dict[str, float]:
    """Every (mode, M, bias, scale kind) case whose kernel output misses ``reference`` beyond TOL."""
    from fv_kernel.compute.fp8_triton import fp8_linear_triton

    g = torch.Generator().manual_seed(3)
    errors: dict[str, float] = {}
    in_f = out_f = 48  # square, so a per-input-channel scale has the right length
    w, s = _quantized_weight(out_f, in_f, g, device)
    bias = torch.randn(out_f, generator=g).to(device)
    for mode in ("fp8_weights", "fp8_dynamic"):
        for m in (0, 1, 37, 300):  # zero rows, one row, odd M, M % 256 != 0 over two M blocks
            x = (torch.randn(m, in_f, generator=g) * torch.logspace(-1, 2, max(m, 1))[:m, None]).to(device)
            for label, b, scale in (("bias", bias, s), ("nobias", None, s), ("per_tensor", bias, s.amax().reshape(()))):
                given = torch.ones_like(scale) if kernel_scale == "dropped" else scale
                got = fp8_linear_triton(x, w, given, b, mode, torch.float32)
                want = reference(x.cpu(), w.cpu(), scale.cpu(), None if b is None else b.cpu(), mode)
                err = _rel(got.cpu(), want)
                if not err < TOL:
                    errors[f"{mode}[M={m},{label}]"] = err
    return errors


def saturation(device: str) -> dict[str, Any]:
    """Huge and tiny activations: finite outputs, equal to the reference; an all-zero row gives the bias."""
    from fv_kernel.compute.fp8_triton import fp8_linear_triton

    g = torch.Generator().manual_seed(4)
    w, s = _quantized_weight(32, 64, g, device)
    bias = torch.randn(32, generator=g).to(device)
    x = torch.randn(5, 64, generator=g)
    x[0] *= 1e20
    x[1] *= 1e-20
    x[2] = 0.0
    x[3, 0] = 3e4  # one outlier far above 448
    x = x.to(device)
    out: dict[str, Any] = {}
    for mode in ("fp8_weights", "fp8_dynamic"):
        y = fp8_linear_triton(x, w, s, bias, mode, torch.float32).cpu()
        want = _ref_linear(x.cpu(), w.cpu(), s.cpu(), bias.cpu(), mode)
        out[mode] = {
            "finite": bool(torch.isfinite(y).all()),
            "row_errors": [_rel(y[i : i + 1], want[i : i + 1]) for i in range(5)],
            "zero_row_is_bias": bool(torch.allclose(y[2], bias.cpu())),
        }
    return out


def _ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1) @ v.double()


def rows_errors(device: str) -> dict[str, float]:
    """The one-pass per-token quantization against the reference above: dequantized values, contiguous
    and strided rows (a column slice of a wider activation)."""
    from fv_kernel.compute.fp8_triton import fp8_quantize_rows

    g = torch.Generator().manual_seed(6)
    out: dict[str, float] = {}
    wide = torch.randn(37, 2100, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    for label, x in (("contiguous", wide[:, :1500].contiguous()), ("strided", wide[:, 300:1800]), ("one_column", wide[:, :1])):
        q, s = fp8_quantize_rows(x.to(device))
        out[label] = _rel(q.cpu().double() * s.cpu().double(), _ref_rows_e4m3(x))
    # rows wider than one tile take the two-pass kernel: force it on small rows (the limit is read at launch)
    from fv_kernel.compute import fp8_triton

    limit = fp8_triton.WHOLE_ROW_LIMIT
    fp8_triton.WHOLE_ROW_LIMIT = 256
    try:
        x = wide[:5, :1500].contiguous()
        q, s = fp8_quantize_rows(x.to(device))
        out["two_pass"] = _rel(q.cpu().double() * s.cpu().double(), _ref_rows_e4m3(x))
    finally:
        fp8_triton.WHOLE_ROW_LIMIT = limit
    return out


def attention_errors(device: str) -> dict[str, float]:
    """Relative errors of the Triton fp8 attention against fp64 attention and the torch reference,
    and of a kernel whose V scale was dropped (negative control)."""
    from fv_kernel.compute import fp8_attention
    from fv_kernel.compute.fp8_attention import (
        fp8_attention_torch,
        fp8_attention_triton,
    )

    g = torch.Generator().manual_seed(5)
    out: dict[str, float] = {}
    # square; odd sizes and head dim; several key blocks with a partial last one (K scales per 128 keys)
    for label, (lq, lk, d) in {"square": (100, 100, 64), "odd": (70, 77, 48), "long": (130, 300, 64)}.items():
        q, k, v = (torch.randn(1, 2, n, d, generator=g).to(device) for n in (lq, lk, lk))
        k = k + 3.0  # a large shared key offset: what K smoothing removes
        got = fp8_attention_triton(q, k, v).cpu()
        out[f"{label}.vs_exact"] = _rel(got, _ref_attention(q.cpu(), k.cpu(), v.cpu()))
        out[f"{label}.vs_torch_reference"] = _rel(got, fp8_attention_torch(q.cpu(), k.cpu(), v.cpu()))
    # (B, L, H, D) viewed as (B, H, L, D): read through strides, not copied
    x = torch.randn(2, 90, 3, 64, generator=g).to(device)
    view = x.transpose(1, 2)
    got = fp8_attention_triton(view, view, view)
    out["strided.vs_exact"] = _rel(got.cpu(), _ref_attention(*(view.cpu(),) * 3))
    out["strided.output_in_q_layout"] = float(got.stride() == view.stride())
    q, k, v = (torch.randn(1, 1, 64, 32, generator=g).to(device) for _ in range(3))
    big = fp8_attention_triton(q * 1e4, k * 1e4, v * 1e4).cpu()
    out["saturation.finite"] = float(torch.isfinite(big).all())
    out["empty_queries.numel"] = float(fp8_attention_triton(q[:, :, :0], k, v).numel())
    kv_statistics = fp8_attention.kv_statistics

    def dropped_v_scale(k_, v_):  # type: ignore[no-untyped-def]
        k_mean, v_scale = kv_statistics(k_, v_)
        return k_mean, torch.full_like(v_scale, 1.0 / 448)

    fp8_attention.kv_statistics = dropped_v_scale
    try:
        q, k, v = (torch.randn(1, 2, 100, 64, generator=g).to(device) * 3 for _ in range(3))
        out["dropped_v_scale.vs_exact"] = _rel(fp8_attention_triton(q, k, v).cpu(), _ref_attention(q.cpu(), k.cpu(), v.cpu()))
    finally:
        fp8_attention.kv_statistics = kv_statistics
    return out


def kernel_checks(device: str) -> dict[str, Any]:
    from fv_kernel.compute.fp8_triton import triton_interpreted

    return {
        "interpreted": triton_interpreted(),
        "linear": linear_errors(device),
        "linear.reference_scale_per_input_channel": linear_errors(
            device, lambda *a: _ref_linear(*a, scale_axis="in")),
        "linear.reference_scale_dropped": linear_errors(device, lambda *a: _ref_linear(*a, drop_scale=True)),
        "linear.kernel_scale_dropped": linear_errors(device, kernel_scale="dropped"),
        "saturation": saturation(device),
        "rows": rows_errors(device),
        "attention": attention_errors(device),
    }


@pytest.fixture(scope="module")
def checks() -> dict[str, Any]:
    results = run_kernel_checks(__file__, lambda: kernel_checks("cuda"), what="the FP8 Triton kernels")
    assert CUDA or results["interpreted"], "TRITON_INTERPRET=1 was set but Triton compiled the kernels for a GPU"
    return results


def test_fp8_linear_kernel_matches_the_dequantized_reference(checks: dict[str, Any]) -> None:
    assert checks["linear"] == {}


def test_comparison_catches_a_scale_on_the_input_channel_axis(checks: dict[str, Any]) -> None:
    failing = checks["linear.reference_scale_per_input_channel"]
    # Every case with rows and per-channel scales fails; one per-tensor scale has no axis to get wrong.
    assert {c for c in failing if "per_tensor" not in c} == {
        f"{mode}[M={m},{b}]" for mode in ("fp8_weights", "fp8_dynamic") for m in (1, 37, 300) for b in ("bias", "nobias")
    }, failing


@pytest.mark.parametrize("control", ["linear.reference_scale_dropped", "linear.kernel_scale_dropped"])
def test_comparison_catches_a_dropped_scale(checks: dict[str, Any], control: str) -> None:
    failing = checks[control]
    assert set(failing) == {
        f"{mode}[M={m},{b}]" for mode in ("fp8_weights", "fp8_dynamic") for m in (1, 37, 300)
        for b in ("bias", "nobias", "per_tensor")
    }, failing


def test_row_quantization_matches_the_reference(checks: dict[str, Any]) -> None:
    # Both round x / (absmax / 448) to nearest even; they differ only in the scale's last fp32 bit.
    assert max(checks["rows"].values()) < 1e-6, checks["rows"]


def test_fp8_linear_saturation_stays_finite(checks: dict[str, Any]) -> None:
    for mode, result in checks["saturation"].items():
        assert result["finite"], mode
        assert result["zero_row_is_bias"], mode
        assert max(result["row_errors"]) < TOL, (mode, result["row_errors"])


def test_fp8_attention_kernel_parity(checks: dict[str, Any]) -> None:
    from fv_kernel.compute.fp8_attention import KERNEL_REL_ERROR, PARITY_REL_ERROR

    att = checks["attention"]
    for label in ("square", "odd", "long"):
        assert att[f"{label}.vs_exact"] < PARITY_REL_ERROR, att
        assert att[f"{label}.vs_torch_reference"] < KERNEL_REL_ERROR, att
    assert att["strided.vs_exact"] < PARITY_REL_ERROR, att
    assert att["strided.output_in_q_layout"] == 1.0  # transposing it back to (B, L, H, D) is free
    assert att["saturation.finite"] == 1.0
    assert att["empty_queries.numel"] == 0.0


def test_fp8_attention_comparison_catches_a_dropped_v_scale(checks: dict[str, Any]) -> None:
    from fv_kernel.compute.fp8_attention import PARITY_REL_ERROR

    assert checks["attention"]["dropped_v_scale.vs_exact"] > PARITY_REL_ERROR


# --------------------------------------------------------------------------- code generated for Hopper (no GPU needed)

needs_triton = pytest.mark.skipif(not triton_available() and not REQUIRE_KERNELS, reason="needs triton")

_SM90_LINEAR = {"as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
                "M": 32760, "N": 1536, "K": 1536}
_SM90_ATTENTION = {"q_ptr": "*bf16", "kq_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "vt_ptr": "*fp8e4nv", "vs_ptr": "*fp32",
                   "o_ptr": "*bf16", "H": 12, "LQ": 32760, "LK": 32760, "LK_PAD": 32768, "D": 128, "stride_qb": 393216 * 128,
                   "stride_qh": 128, "stride_ql": 1536, "stride_ob": 393216 * 128, "stride_oh": 128, "stride_ol": 1536,
                   "qk_scale": "fp32", "LK_BUCKET": 32768}


@needs_triton
@pytest.mark.parametrize("dynamic", [True, False])
def test_fp8_linear_builds_tensor_core_code_for_sm90(dynamic: bool) -> None:
    """``fp8_dynamic`` multiplies e4m3 by e4m3 on Hopper's tensor cores (wgmma); ``fp8_weights``
    widens to bf16 and uses bf16 wgmma; no register spills at the launcher's tiles."""
    from fv_kernel.compute.fp8_triton import _fp8_linear_kernel
    from fv_kernel.testing.triton_checks import compile_for_sm90

    values = {**_SM90_LINEAR, "a_ptr": "*fp8e4nv" if dynamic else "*bf16"}
    tiles = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128} if dynamic else {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}
    build = compile_for_sm90(_fp8_linear_kernel, values, {
        "A_E4M3": dynamic, "HAS_BIAS": True, "PRECISION": "tf32", "GROUP_M": 8, **tiles}, num_warps=8 if dynamic else 4)
    wgmma = set(re.findall(r"wgmma\.mma_async\S*", build.ptx))
    if dynamic:
        assert wgmma and all(".e4m3.e4m3" in op for op in wgmma), wgmma
    else:
        assert wgmma and all(".bf16.bf16" in op for op in wgmma), wgmma
    assert build.spill_bytes == 0


@needs_triton
def test_row_quantization_builds_a_saturating_e4m3_cast_for_sm90() -> None:
    from fv_kernel.compute.fp8_triton import _quantize_rows_kernel
    from fv_kernel.testing.triton_checks import compile_for_sm90

    for k, rows, block_k, whole, warps in ((1536, 2, 2048, True, 4), (8960, 1, 16384, True, 8), (20480, 4, 1024, False, 4)):
        build = compile_for_sm90(_quantize_rows_kernel, {"x_ptr": "*bf16", "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32",
                                                         "M": 32760, "K": k, "stride_xm": k},
                                 {"EMULATE_ROUNDING": False, "ROWS": rows, "BLOCK_K": block_k, "WHOLE_ROWS": whole, "GELU": False},
                                 num_warps=warps)
        assert "cvt.rn.satfinite.e4m3x2.f32" in build.ptx, k
        assert build.spill_bytes == 0, (k, build.spill_bytes)


@needs_triton
@pytest.mark.parametrize("config", range(8))
def test_fp8_attention_builds_e4m3_tensor_core_code_for_sm90(config: int) -> None:
    """Q·Kᵀ and P·V both on e4m3 wgmma at every autotune candidate, spilling (almost) nothing."""
    from fv_kernel.compute.fp8_triton import ATTENTION_CONFIGS

    assert len(ATTENTION_CONFIGS) == 8
    from fv_kernel.compute.fp8_triton import ATTENTION_CONFIGS, K_SCALE_BLOCK, _fp8_attention_kernel
    from fv_kernel.testing.triton_checks import compile_for_sm90

    cfg = ATTENTION_CONFIGS[config]
    build = compile_for_sm90(_fp8_attention_kernel, _SM90_ATTENTION, {
        "EMULATE_ROUNDING": False, "KSB": K_SCALE_BLOCK, "BLOCK_D": 128, **cfg.kwargs},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    wgmma = set(re.findall(r"wgmma\.mma_async\S*", build.ptx))
    assert wgmma and all(".f32.e4m3.e4m3" in op for op in wgmma), wgmma  # Q·Kᵀ and P·V
    assert build.spill_bytes <= 128, build.spill_bytes


if __name__ == "__main__":  # the fixture's fresh-process run (TRITON_INTERPRET=1 set by the caller)
    print(json.dumps(kernel_checks("cpu")))
