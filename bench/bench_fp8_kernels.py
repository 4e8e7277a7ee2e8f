"""GPU microbenchmark of the FP8 kernels (docs/precision.md) at Wan-1.3B 480x832x81 shapes (32,760
tokens): the linears (``scaled_mm`` fp8_dynamic = Triton row quantization + ``torch._scaled_mm``,
its parts alone, the old eager quantization, fp8_weights as dequantize + bf16 GEMM, the Triton GEMMs)
against bf16 ``F.linear``; the Triton e4m3 attention (statistics, K/V quantization, attention) against
SDPA-cuDNN bf16, also at Wan-14B 720p's 40 heads x 75,600 tokens; the fused norm/GELU ops that write
e4m3 rows (``FusedOps.*_fp8``) against the op plus a separate row quantization. ``--sweep`` times the GEMM's
tiles and every attention autotune candidate. Prints one JSON object; ``--out`` writes it too.

    python bench/bench_fp8_kernels.py --out bench/records/fp8_kernels_h200.json

Exits 0 with ``{"skipped": ...}`` without CUDA.
"""

# ruff: noqa: B023  (every closure in a loop is timed before the loop moves on)
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SECTIONS = ("fused_quantization", "linear", "attention", "cross_attention_1.3b", "attention_14b_720p")
LINEAR_SHAPES = {"qkvo 32760x1536x1536": (32760, 1536, 1536), "ffn_up 32760x1536x8960": (32760, 1536, 8960),
                 "ffn_down 32760x8960x1536": (32760, 8960, 1536)}


def _ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bench_linear(sweep: bool) -> dict[str, Any]:
    import triton

    from fv_kernel.compute.fp8 import (
        _scaled_mm_kernel,
        quantize_e4m3,
        quantize_rows_e4m3,
    )
    from fv_kernel.compute.fp8_triton import _fp8_linear_kernel, fp8_linear_triton, fp8_quantize_rows

    out: dict[str, Any] = {}
    for label, (m, k, n) in LINEAR_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
        bias = torch.randn(n, device="cuda", generator=g).bfloat16() * 0.01
        wq, ws = quantize_e4m3(w, axis=0)
        ws = ws.reshape(-1)
        flops = 2 * m * k * n
        ref = F.linear(x.float(), w.float(), bias.float())
        xq, xs = fp8_quantize_rows(x)
        wsr = ws.reshape(1, -1).contiguous()
        row: dict[str, Any] = {
            "bf16 F.linear": _ms(lambda: F.linear(x, w, bias)),
            "scaled_mm fp8_dynamic (Triton row quant + GEMM)": _ms(
                lambda: _scaled_mm_kernel(x, wq, ws, bias, "fp8_dynamic", torch.bfloat16)),
            "scaled_mm GEMM only": _ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=wsr, out_dtype=torch.bfloat16, bias=bias)),
            "Triton row quant only": _ms(lambda: fp8_quantize_rows(x)),
            "eager row quant only": _ms(lambda: quantize_rows_e4m3(x)),
            "scaled_mm fp8_weights (dequant + bf16 GEMM)": _ms(
                lambda: _scaled_mm_kernel(x, wq, ws, bias, "fp8_weights", torch.bfloat16)),
            "triton fp8_dynamic": _ms(lambda: fp8_linear_triton(x, wq, ws, bias, "fp8_dynamic", torch.bfloat16)),
            "triton fp8_weights": _ms(lambda: fp8_linear_triton(x, wq, ws, bias, "fp8_weights", torch.bfloat16)),
            "rel_err triton fp8_dynamic vs fp32": _rel(fp8_linear_triton(x, wq, ws, bias, "fp8_dynamic", torch.bfloat16), ref),
            "rel_err scaled_mm vs fp32": _rel(_scaled_mm_kernel(x, wq, ws, bias, "fp8_dynamic", torch.bfloat16), ref),
            "rel_err triton fp8_weights vs fp32": _rel(fp8_linear_triton(x, wq, ws, bias, "fp8_weights", torch.bfloat16), ref),
        }
        row["tflops"] = {key: flops / (v * 1e-3) / 1e12 for key, v in row.items()
                         if not key.startswith("rel_err") and "quant only" not in key}
        if sweep:
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            configs: dict[str, Any] = {}
            for dynamic in (True, False):
                a = xq if dynamic else x
                for bm, bn, bk, warps, stages in ((128, 256, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3),
                                                  (128, 128, 64, 4, 4), (256, 128, 128, 8, 3), (64, 256, 128, 4, 3)):
                    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

                    def launch() -> None:
                        _fp8_linear_kernel[grid](a, xs, wq, ws, bias, y, m, n, k, A_E4M3=dynamic, HAS_BIAS=True,
                                                 PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                                 num_warps=warps, num_stages=stages)

                    name = f"{'dynamic (GEMM only)' if dynamic else 'weights'} {bm}x{bn}x{bk} w{warps} s{stages}"
                    try:
                        configs[name] = _ms(launch)
                    except Exception as exc:  # noqa: BLE001 - out of shared memory for this config
                        configs[name] = type(exc).__name__
            row["sweep_ms"] = configs
        out[label] = row
    return out


def bench_attention(sweep: bool, heads: int = 12, length: int = 32760, keys: int | None = None) -> dict[str, Any]:
    """``length`` queries over ``keys`` keys (default: as many, a self-attention; Wan's cross-attention has 512)."""
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fv_kernel.compute.fp8_attention import fp8_attention_triton, kv_statistics
    from fv_kernel.compute.fp8_triton import (
        ATTENTION_CONFIGS,
        K_SCALE_BLOCK,
        _fp8_attention_kernel,
        _fp8_attention_tuned,
        _quantize_kv_kernel,
    )

    b, h, d = 1, heads, 128
    keys = length if keys is None else keys
    g = torch.Generator(device="cuda").manual_seed(1)
    # (B, L, H, D) viewed as (B, H, L, D): the layout the Wan blocks hand the driver
    q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=g).bfloat16().transpose(1, 2) for n in (length, keys, keys))
    flops = 4 * b * h * length * keys * d
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v)
        cudnn = _ms(lambda: F.scaled_dot_product_attention(q, k, v))
    exact = F.scaled_dot_product_attention(q[:, :2, :4096].float(), k[:, :2].float(), v[:, :2].float())
    got = fp8_attention_triton(q, k, v)  # runs the autotuner once for this shape
    fp8 = _ms(lambda: fp8_attention_triton(q, k, v))
    k_mean, v_scale = kv_statistics(k, v)
    lk_pad = triton.cdiv(keys, K_SCALE_BLOCK) * K_SCALE_BLOCK
    bh = b * h
    kq = torch.empty(bh, lk_pad, d, dtype=torch.float8_e4m3fn, device="cuda")
    vt = torch.empty(bh, d, lk_pad, dtype=torch.float8_e4m3fn, device="cuda")
    ks = torch.empty(bh, lk_pad // K_SCALE_BLOCK, device="cuda")

    def quantize() -> None:
        _quantize_kv_kernel[(lk_pad // K_SCALE_BLOCK, bh)](
            k, v, k_mean, v_scale, kq, ks, vt, h, keys, lk_pad, d, k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), EMULATE_ROUNDING=False, KSB=K_SCALE_BLOCK, BLOCK_D=d, num_warps=4)

    out: dict[str, Any] = {
        "shape": [b, h, length, d], "keys": keys, "sdpa_cudnn bf16 ms": cudnn, "fp8 triton ms (all: stats, K/V quant, attention)": fp8,
        "kv_statistics ms": _ms(lambda: kv_statistics(k, v)), "K/V quant kernel ms": _ms(quantize),
        "autotuned config": str(getattr(_fp8_attention_tuned, "best_config", None)),
        "tflops": {"cudnn": flops / cudnn / 1e9, "fp8 (all)": flops / fp8 / 1e9},
        "rel_err fp8 vs fp32 (2 heads, 4096 queries)": _rel(got[:, :2, :4096], exact),
        "rel_err cudnn bf16 vs fp32": _rel(ref[:, :2, :4096], exact),
    }
    if sweep and keys == length:
        quantize()
        o = torch.empty_like(q)
        configs: dict[str, Any] = {}
        for cfg in ATTENTION_CONFIGS:
            kw = cfg.all_kwargs()

            def launch() -> None:
                _fp8_attention_kernel[(triton.cdiv(length, kw["BLOCK_M"]), bh)](
                    q, kq, ks, vt, v_scale, o, h, length, length, lk_pad, d, q.stride(0), q.stride(1), q.stride(2),
                    o.stride(0), o.stride(1), o.stride(2), d**-0.5 * 1.4426950408889634, triton.next_power_of_2(length), EMULATE_ROUNDING=False,
                    KSB=K_SCALE_BLOCK, BLOCK_D=d, **kw)

            name = f"{kw['BLOCK_M']}x{kw['BLOCK_N']} w{cfg.num_warps} s{cfg.num_stages}"
            try:
                ms = _ms(launch)
                configs[name] = {"ms": ms, "tflops": flops / ms / 1e9}
            except Exception as exc:  # noqa: BLE001
                configs[name] = type(exc).__name__
        out["kernel-only sweep"] = configs
    return out


def bench_fused_quantization() -> dict[str, Any]:
    """The ops feeding fp8_dynamic linears at Wan-1.3B's widths: each ``*_fp8`` fused op against the op in
    bf16 followed by the linear's own row quantization (what runs without it), and the bf16 op alone."""
    from fv_kernel.compute.fp8_triton import fp8_quantize_rows
    from fv_kernel.compute.fused import TritonFusedOps

    ops = TritonFusedOps()
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1, 32760, 1536, device="cuda", generator=g).bfloat16()
    y = torch.randn(1, 32760, 1536, device="cuda", generator=g).bfloat16()
    scale, shift = (torch.randn(1, 1, 1536, device="cuda", generator=g) * 0.1 for _ in range(2))
    hidden = torch.randn(1, 32760, 8960, device="cuda", generator=g).bfloat16()

    def rows(t: torch.Tensor) -> Any:
        return fp8_quantize_rows(t.reshape(-1, t.shape[-1]))

    cases = {
        "modulated_norm 32760x1536": (lambda: ops.modulated_layer_norm(x, scale, shift, 1e-6),
                                      lambda: rows(ops.modulated_layer_norm(x, scale, shift, 1e-6)),
                                      lambda: ops.modulated_layer_norm_fp8(x, scale, shift, 1e-6)),
        "residual_modulated_norm 32760x1536": (
            lambda: ops.residual_layer_norm(x, y, None, 1e-6, scale=scale, shift=shift),
            lambda: rows(ops.residual_layer_norm(x, y, None, 1e-6, scale=scale, shift=shift)[1]),
            lambda: ops.residual_layer_norm_fp8(x, y, None, 1e-6, scale=scale, shift=shift)),
        "gelu_tanh 32760x8960": (lambda: F.gelu(hidden, approximate="tanh"),
                                 lambda: rows(F.gelu(hidden, approximate="tanh")),
                                 lambda: ops.gelu_tanh_fp8(hidden)),
    }
    out = {label: {"bf16 op alone": _ms(op), "bf16 op + row quantization": _ms(composed), "fused *_fp8": _ms(fused)}
           for label, (op, composed, fused) in cases.items()}
    # The fused GELU's launch forms (fp8_gelu_quantize_rows picks one by GELU_WHOLE_ROW_LIMIT): whole rows in
    # one pass, or two passes over chunks of a row (the GELU recomputed in the second), by chunk, tile, warps.
    from fv_kernel.compute.fp8_triton import _launch_quantize_rows

    flat = hidden.reshape(-1, hidden.shape[-1])
    forms = {"one pass, whole rows, 8 warps": dict(whole_row_limit=16384, num_warps=8),
             "one pass, whole rows, 16 warps": dict(whole_row_limit=16384, num_warps=16)}
    for block_k, tile, warps in ((1024, 4096, 4), (1024, 4096, 8), (2048, 4096, 8), (1024, 8192, 8), (512, 2048, 4)):
        forms[f"two passes, chunk {block_k}, tile {tile}, {warps} warps"] = dict(
            whole_row_limit=0, block_k=block_k, tile=tile, num_warps=warps)
    out["gelu_tanh 32760x8960 forms"] = {label: _ms(lambda kw=kw: _launch_quantize_rows(flat, gelu=True, **kw))
                                         for label, kw in forms.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sweep", action="store_true", help="also time several block-size configurations")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to time (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    benches = {
        "fused_quantization": bench_fused_quantization,
        "linear": lambda: bench_linear(args.sweep), "attention": lambda: bench_attention(args.sweep),
        # Wan's cross-attention (512 text tokens) runs through the same driver on the fp8 paths.
        "cross_attention_1.3b": lambda: bench_attention(False, heads=12, length=32760, keys=512),
        "attention_14b_720p": lambda: bench_attention(False, heads=40, length=75600),
    }
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              **{name: benches[name]() for name in args.sections}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
