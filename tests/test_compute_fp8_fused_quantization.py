"""The fused ops that write e4m3 rows for fp8_dynamic linears (``FusedOps.*_fp8``, docs/precision.md).

Three things are checked, on CUDA compiled or on CPU in Triton's interpreter (a fresh Python, see
fv_kernel.testing.triton_checks):

- against references in fp64 (LayerNorm, modulation, residual and the tanh GELU written here, then the
  fp8 kernel tests' per-row absmax/448 e4m3 quantization), sharing nothing with fv_kernel's code: the
  dequantized rows are compared by relative Frobenius error;
- against the composed path an fp8_dynamic linear takes without them (the Triton norm, then
  ``fp8_quantize_rows``): the norms' e4m3 bytes and scales are bitwise those, so fusing them does
  not change what the precision path computes;
- negative controls, each a bug in what the kernel hands the linear: the scale dropped, row 0's
  scale used for every row, and a reference that scales per column (the wrong axis). Each must fail
  the same comparison.

The linear's side (``Fp8Linear`` taking ``QuantizedRows``) is checked on CPU with the torch kernel.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from fv_kernel.compute.fp8 import Fp8Error, Fp8Linear, QuantizedRows, takes_quantized_rows
from fv_kernel.compute.fused import TorchFusedOps
from fv_kernel.testing.triton_checks import run_kernel_checks

from test_compute_fp8_kernels import _ref_rows_e4m3

#: Relative Frobenius error between the kernel's dequantized rows and the fp64 reference's, per dtype.
#: fp32 norms: the same e4m3 codes (the scales differ in their last bits). bf16, and the GELU in any dtype
#: (its tanh through exp): the kernel rounds the row to
#: bf16 from fp32 arithmetic (the GELU's tanh through exp), the reference from fp64, so a value a bf16 ulp
#: apart may land one e4m3 step (6-12%) away: a few such codes give a relative error of 1e-2, as on an H100
#: (2026-12-06). So in bf16 the rows are judged code by code (BF16_CODES_OFF, at most one step each), and
#: the relative error is used only by the negative controls (TOL, times ten). Triton's interpreter truncates
#: fp32 -> bf16 casts (half the values one bf16 ulp off torch's round-to-nearest-even), so the bf16
#: comparisons with torch run on CUDA only.
TOL = {"float32": 1e-6, "bfloat16": 2e-3}
#: In bf16: the largest fraction of codes not the reference's (each at most one e4m3 step off).
BF16_CODES_OFF = 0.01
WIDTH = 96
GELU_WIDE = 4100  # > fp8_triton.GELU_WHOLE_ROW_LIMIT (checked below)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or not torch.isfinite(a).all():
        return float("inf")
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _ref_quantized(v: torch.Tensor, *, axis: str = "row") -> torch.Tensor:
    """Quantize-dequantize (M, K) values per row, as the fp8 kernel tests' reference does (or, the broken
    reference, per column)."""
    return _ref_rows_e4m3(v) if axis == "row" else _ref_rows_e4m3(v.t()).t()


def _code_index(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as signed step counts from zero (the magnitude bits order the values)."""
    bits = codes.view(torch.uint8).int()
    magnitude = bits & 0x7F
    return torch.where(bits & 0x80 != 0, -magnitude, magnitude)


def _ref_layer_norm(h: torch.Tensor, eps: float) -> torch.Tensor:
    mean = h.mean(dim=-1, keepdim=True)
    var = ((h - mean) ** 2).mean(dim=-1, keepdim=True)
    return (h - mean) / torch.sqrt(var + eps)


def _ref_gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3)))


def _inputs(dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    # Rows of very different sizes and per-token modulation, so a scale from the wrong row shows.
    x = torch.randn(2, 9, WIDTH, generator=g) * torch.logspace(-2, 2, 9).reshape(1, 9, 1)
    return {
        "x": x.to(dtype), "y": torch.randn(2, 9, WIDTH, generator=g).to(dtype),
        "gate": torch.randn(2, 1, WIDTH, generator=g), "scale": torch.randn(2, 9, WIDTH, generator=g) * 0.5,
        "shift": torch.randn(2, 9, WIDTH, generator=g) * 0.5, "weight": torch.randn(WIDTH, generator=g),
        "bias": torch.randn(WIDTH, generator=g), "hidden": (torch.randn(3, 7, 4 * WIDTH, generator=g) * 3).to(dtype),
        # Wider than GELU_WHOLE_ROW_LIMIT: the kernel's two passes over 1024-wide chunks (the last one partial).
        "hidden_wide": (torch.randn(5, GELU_WIDE, generator=g) * 3 * torch.logspace(-1, 1, 5)[:, None]).to(dtype),
    }


def _cases(ops: Any, t: dict[str, torch.Tensor], eps: float) -> dict[str, tuple[QuantizedRows, torch.Tensor, Any]]:
    """Each fused op's rows, its fp64 reference values (before quantization, rounded to the activation
    dtype as the op rounds them), and the composed op's rows (norm then the linear's own quantization)."""
    from fv_kernel.compute.fp8_triton import fp8_quantize_rows

    dtype = t["x"].dtype
    x64, y64 = t["x"].double(), t["y"].double()
    residual = (x64 + y64 * t["gate"].double()).to(dtype).double()
    plain = (x64 + y64).to(dtype).double()

    def composed(normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_quantize_rows(normed.reshape(-1, normed.shape[-1]))

    out: dict[str, tuple[QuantizedRows, torch.Tensor, Any]] = {}
    rows = ops.modulated_layer_norm_fp8(t["x"], t["scale"], t["shift"], eps)
    ref = _ref_layer_norm(x64, eps) * (1 + t["scale"].double()) + t["shift"].double()
    out["modulated_norm"] = (rows, ref, composed(ops.modulated_layer_norm(t["x"], t["scale"], t["shift"], eps)))

    x_new, rows = ops.residual_layer_norm_fp8(t["x"], t["y"], t["gate"], eps, weight=t["weight"], bias=t["bias"])
    ref = _ref_layer_norm(residual, eps) * t["weight"].double() + t["bias"].double()
    x_composed, normed = ops.residual_layer_norm(t["x"], t["y"], t["gate"], eps, weight=t["weight"], bias=t["bias"])
    assert torch.equal(x_new, x_composed), "the residual stream must not change when its norm is quantized"
    out["gated_residual_affine_norm"] = (rows, ref, composed(normed))

    _, rows = ops.residual_layer_norm_fp8(t["x"], t["y"], None, eps, scale=t["scale"], shift=t["shift"])
    ref = _ref_layer_norm(plain, eps) * (1 + t["scale"].double()) + t["shift"].double()
    out["residual_modulated_norm"] = (
        rows, ref, composed(ops.residual_layer_norm(t["x"], t["y"], None, eps, scale=t["scale"], shift=t["shift"])[1]))

    rows = ops.gelu_tanh_fp8(t["hidden"])
    out["gelu_tanh"] = (rows, _ref_gelu_tanh(t["hidden"].double()), composed(
        torch.nn.functional.gelu(t["hidden"], approximate="tanh")))
    rows = ops.gelu_tanh_fp8(t["hidden_wide"])
    out["gelu_tanh_two_pass"] = (rows, _ref_gelu_tanh(t["hidden_wide"].double()), composed(
        torch.nn.functional.gelu(t["hidden_wide"], approximate="tanh")))
    for name, (rows, ref, want) in out.items():
        out[name] = (rows, ref.to(dtype).double().reshape(-1, ref.shape[-1]), want)
    return out


def fused_quantization_checks(device: str) -> dict[str, Any]:
    from fv_kernel.compute.fused import TritonFusedOps

    from fv_kernel.compute.fp8_triton import GELU_WHOLE_ROW_LIMIT

    assert GELU_WIDE > GELU_WHOLE_ROW_LIMIT  # the wide GELU case runs the two-pass form
    ops = TritonFusedOps()
    g = torch.Generator().manual_seed(11)
    result: dict[str, Any] = {"interpreted": ops.interpreted, "errors": {}, "bitwise_composed": {},
                              "code_mismatch_fraction": {}, "controls": {}, "codes_off": {}, "worst_steps_off": {},
                              "scale_error": {}}
    for dtype in (torch.float32, torch.bfloat16):
        t = {k: v.to(device) for k, v in _inputs(dtype, g).items()}
        for name, (rows, ref, (q, s)) in _cases(ops, t, 1e-6).items():
            key = f"{name}[{str(dtype).removeprefix('torch.')}]"
            got = rows.data.cpu().double() * rows.scale.cpu().double()
            want = _ref_quantized(ref.cpu())
            result["errors"][key] = _rel(got, want)
            # Code by code: the fraction of e4m3 codes not the reference's, and the worst distance in codes
            # (an e4m3 byte's magnitude bits count its steps from zero), and the scales' relative difference.
            ref_scale = (ref.cpu().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
            ref_codes = (want / ref_scale).float().to(torch.float8_e4m3fn)  # exact: want is codes x ref_scale
            distance = (_code_index(rows.data.cpu()) - _code_index(ref_codes)).abs()
            result["codes_off"][key] = (distance > 0).double().mean().item()
            result["worst_steps_off"][key] = int(distance.max())
            result["scale_error"][key] = ((rows.scale.cpu().double() - ref_scale) / ref_scale).abs().max().item()
            same_codes = torch.equal(rows.data.view(torch.uint8), q.view(torch.uint8))
            result["bitwise_composed"][key] = same_codes and torch.equal(rows.scale, s)
            result["code_mismatch_fraction"][key] = (rows.data.view(torch.uint8) != q.view(torch.uint8)).float().mean().item()
            scale = rows.scale.cpu().double()
            data = rows.data.cpu().double()
            result["controls"][key] = {
                "scale_dropped": _rel(data, want),
                "row0_scale_for_every_row": _rel(data * scale[:1], want),
                "reference_scaled_per_column": _rel(got, _ref_quantized(ref.cpu(), axis="column")),
            }
    # The Triton linear given the rows (x_scale) computes what it computes quantizing the tensor itself.
    from fv_kernel.compute.fp8_triton import fp8_linear_triton

    linear = _linear()
    x = (torch.randn(37, WIDTH, generator=g) * torch.logspace(-2, 2, 37)[:, None]).to(device)
    rows = QuantizedRows.quantize(x) if device == "cuda" else _triton_rows(x)
    weight, scale, bias = linear.weight.to(device), linear.weight_scale.to(device), linear.bias.to(device)
    given = fp8_linear_triton(rows.data, weight, scale, bias, "fp8_dynamic", torch.float32, x_scale=rows.scale)
    result["linear_given_rows_equals_linear"] = torch.equal(
        given, fp8_linear_triton(x, weight, scale, bias, "fp8_dynamic", torch.float32))
    return result


def _triton_rows(x: torch.Tensor) -> QuantizedRows:
    from fv_kernel.compute.fp8_triton import fp8_quantize_rows

    return QuantizedRows(*fp8_quantize_rows(x), x.shape, x.dtype)


@pytest.fixture(scope="module")
def checks() -> dict[str, Any]:
    results = run_kernel_checks(__file__, lambda: fused_quantization_checks("cuda"), what="the fused fp8 quantization")
    assert torch.cuda.is_available() or results["interpreted"]
    return results


def _dtype(case: str) -> str:
    return case.rsplit("[", 1)[1].rstrip("]")


def _compared_with_torch(checks: dict[str, Any], table: str) -> dict[str, Any]:
    """The cases of ``table`` whose comparison with torch's rounding is meaningful here (see ``TOL``)."""
    return {k: v for k, v in checks[table].items() if not (checks["interpreted"] and _dtype(k) == "bfloat16")}


def test_the_triton_linear_given_quantized_rows_computes_what_it_computes_from_the_tensor(checks: dict[str, Any]) -> None:
    assert checks["linear_given_rows_equals_linear"]


def test_fused_ops_write_the_references_e4m3_rows(checks: dict[str, Any]) -> None:
    errors = _compared_with_torch(checks, "errors")
    assert len(errors) == (5 if checks["interpreted"] else 10)
    # fp32 norms: the reference's codes, within 1e-6. The GELU (its tanh through exp) and every bf16 row:
    # code by code, since one code moved a step in a large row is a relative error of about 1e-4-1e-3
    # (the fp32 two-pass GELU gave 4.1e-4 on an H100, one such code).
    exact = [case for case in errors if _dtype(case) == "float32" and not case.startswith("gelu")]
    over = {case: errors[case] for case in exact if not errors[case] < TOL["float32"]}
    assert len(exact) == 3 and not over, over
    off = {case: (checks["codes_off"][case], checks["worst_steps_off"][case], checks["scale_error"][case])
           for case in errors if case not in exact}
    assert len(off) == (2 if checks["interpreted"] else 7)
    # A scale from a bf16 absmax one ulp apart differs by 2^-8 at most.
    assert all(fraction <= BF16_CODES_OFF and steps <= 1 and scale <= 2.0**-8 for fraction, steps, scale in off.values()), off
    assert all(checks["codes_off"][case] == 0 for case in exact), checks["codes_off"]


def test_fused_norms_are_bitwise_the_norm_then_the_linears_own_quantization(checks: dict[str, Any]) -> None:
    norms = {k: v for k, v in checks["bitwise_composed"].items() if not k.startswith("gelu")}
    assert len(norms) == 6 and all(norms.values()), norms


def test_fused_gelu_matches_torchs_gelu_then_quantization_code_for_code_but_for_rounding_ties(checks: dict[str, Any]) -> None:
    # The kernel's tanh (through exp) and torch's differ in the last fp32 bits; after rounding to the
    # activation dtype a value on an e4m3 boundary can take the neighbouring code.
    gelu = {k: v for k, v in _compared_with_torch(checks, "code_mismatch_fraction").items() if k.startswith("gelu")}
    assert len(gelu) == (2 if checks["interpreted"] else 4) and all(v <= 0.01 for v in gelu.values()), gelu


@pytest.mark.parametrize("control", ["scale_dropped", "row0_scale_for_every_row", "reference_scaled_per_column"])
def test_the_comparison_catches_a_broken_scale(checks: dict[str, Any], control: str) -> None:
    errors = {case: controls[control] for case, controls in checks["controls"].items()}
    assert len(errors) == 10 and all(err > 10 * TOL[_dtype(case)] for case, err in errors.items()), errors


# --------------------------------------------------------------------------- code generated for Hopper (no GPU needed)


@pytest.mark.parametrize("kernel", ["residual_norm_kernel", "gelu_quantize_rows"])
def test_the_fused_quantizing_kernels_build_a_saturating_e4m3_cast_for_sm90(kernel: str) -> None:
    """At Wan-1.3B's widths (1536 for the norms, 8960 for the GELU, as fp8_gelu_quantize_rows launches it):
    the hardware's round-to-nearest saturating e4m3 cast, and no register spills."""
    from fv_kernel.compute.fused import triton_available

    if not triton_available():
        pytest.skip("needs triton")
    from fv_kernel.compute import fp8_triton, fused_kernels
    from fv_kernel.testing.triton_checks import compile_for_sm90

    if kernel == "residual_norm_kernel":
        pointers = ("x_ptr", "y_ptr", "x_out_ptr", "out_ptr", "weight_ptr", "bias_ptr")
        values = {**dict.fromkeys(pointers, "*bf16"), **dict.fromkeys(("gate_ptr", "scale_ptr", "shift_ptr"), "*fp32"),
                  "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "tokens": 32760, "width": 1536, "eps": "fp32",
                  **dict.fromkeys(("stride_gate_b", "stride_gate_l", "stride_mod_b", "stride_mod_l", "stride_shift_b",
                                   "stride_shift_l"), 0)}
        constexprs = {"HAS_RESIDUAL": True, "HAS_GATE": False, "HAS_NORM": True, "HAS_AFFINE": False, "HAS_MOD": True,
                      "QUANTIZE": True, "EMULATE": False, "BLOCK": 2048}
        warps = 8
        function = fused_kernels.residual_norm_kernel
    else:
        assert 8960 > fp8_triton.GELU_WHOLE_ROW_LIMIT  # the two-pass form, 4 rows of 1024-wide chunks a program
        values = {"x_ptr": "*bf16", "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "M": 32760, "K": 8960, "stride_xm": 8960}
        constexprs = {"EMULATE_ROUNDING": False, "ROWS": 4, "BLOCK_K": 1024, "WHOLE_ROWS": False, "GELU": True}
        function, warps = fp8_triton._quantize_rows_kernel, 4
    build = compile_for_sm90(function, values, constexprs, num_warps=warps)
    assert "cvt.rn.satfinite.e4m3x2.f32" in build.ptx
    assert build.spill_bytes == 0, build.spill_bytes


# --------------------------------------------------------------------------- the linear's side (CPU, torch kernel)


def _linear(mode: str = "fp8_dynamic", kernel: str = "torch") -> Fp8Linear:
    g = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(WIDTH, 32)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, WIDTH, generator=g) * torch.logspace(-2, 1, 32)[:, None])
    return Fp8Linear.from_linear(linear, mode=mode, kernel=kernel)


# "auto" (the kernel models get by default) picks its kernel from the rows' device: it once read a
# tensor's .device off the QuantizedRows and failed on the first fused step (found on an H100).
@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_an_fp8_dynamic_linear_given_quantized_rows_computes_what_it_computes_from_the_tensor(kernel: str) -> None:
    linear = _linear(kernel=kernel)
    x = torch.randn(2, 5, WIDTH) * torch.logspace(-2, 2, 5).reshape(1, 5, 1)
    rows = QuantizedRows.quantize(x)
    assert rows.shape == x.shape and rows.dtype == x.dtype
    assert torch.equal(linear(rows), linear(x))
    assert torch.equal(TorchFusedOps().gelu_tanh_fp8(x).data.view(torch.uint8),
                       QuantizedRows.quantize(torch.nn.functional.gelu(x, approximate="tanh")).data.view(torch.uint8))


def test_quantized_rows_are_refused_where_they_cannot_run() -> None:
    rows = QuantizedRows.quantize(torch.randn(3, WIDTH))
    with pytest.raises(Fp8Error, match="only on an fp8_dynamic linear"):
        _linear("fp8_weights")(rows)
    with pytest.raises(Fp8Error, match="fp32 scale"):
        QuantizedRows(rows.data, rows.scale[:2], rows.shape, rows.dtype)
    with pytest.raises(Fp8Error, match="e4m3 data"):
        QuantizedRows(rows.data.float(), rows.scale, rows.shape, rows.dtype)


def test_only_fp8_dynamic_linears_take_quantized_rows() -> None:
    assert takes_quantized_rows(_linear(), _linear())
    assert not takes_quantized_rows(_linear(), _linear("fp8_weights"))
    assert not takes_quantized_rows(_linear(), torch.nn.Linear(WIDTH, 32))
    assert not takes_quantized_rows()


if __name__ == "__main__":  # the fixture's fresh-process run (TRITON_INTERPRET=1 set by the caller)
    print(json.dumps(fused_quantization_checks("cpu")))
