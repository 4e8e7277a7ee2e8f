"""GPU microbenchmark of the FP8 kernels (docs/precision.md): the Triton e4m3 linear against bf16
``F.linear`` and ``torch._scaled_mm`` (rowwise, with and without its eager activation quantization),
and the Triton e4m3 attention against SDPA-cuDNN bf16, at Wan-1.3B 480x832x81 shapes (32,760 tokens).
Also sweeps the kernels' block sizes. Prints one JSON object; ``--out`` writes it too.

    python bench/bench_fp8_kernels.py --out bench/records/fp8_kernels_h200.json

Exits 0 with ``{"skipped": ...}`` without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINEAR_SHAPES = {"qkvo 32760x1536x1536": (32760, 1536, 1536), "ffn_up 32760x1536x8960": (32760, 1536, 8960),
                 "ffn_down 32760x8960x1536": (32760, 8960, 1536)}


def _ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bench_linear(sweep: bool) -> dict[str, Any]:
    import triton

    from fv_kernel.compute.fp8 import _scaled_mm_kernel, quantize_e4m3, quantize_rows_e4m3
    from fv_kernel.compute.fp8_triton import _fp8_linear_kernel, fp8_linear_triton

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
        row: dict[str, Any] = {}
        row["bf16 F.linear"] = _ms(lambda: F.linear(x, w, bias))
        row["scaled_mm incl. eager quant"] = _ms(lambda: _scaled_mm_kernel(x, wq, ws, bias, "fp8_dynamic", torch.bfloat16))
        xq, xs = quantize_rows_e4m3(x)
        wsr = ws.reshape(1, -1).contiguous()
        row["scaled_mm GEMM only"] = _ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=wsr, out_dtype=torch.bfloat16, bias=bias))
        row["triton fp8_dynamic"] = _ms(lambda: fp8_linear_triton(x, wq, ws, bias, "fp8_dynamic", torch.bfloat16))
        row["triton fp8_weights"] = _ms(lambda: fp8_linear_triton(x, wq, ws, bias, "fp8_weights", torch.bfloat16))
        row["rel_err triton fp8_dynamic vs fp32"] = _rel(fp8_linear_triton(x, wq, ws, bias, "fp8_dynamic", torch.bfloat16), ref)
        row["rel_err scaled_mm vs fp32"] = _rel(_scaled_mm_kernel(x, wq, ws, bias, "fp8_dynamic", torch.bfloat16), ref)
        row["rel_err triton fp8_weights vs fp32"] = _rel(fp8_linear_triton(x, wq, ws, bias, "fp8_weights", torch.bfloat16), ref)
        row["tflops"] = {key: flops / (v * 1e-3) / 1e12 for key, v in row.items() if not key.startswith("rel_err")}
        if sweep:
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            configs: dict[str, float] = {}
            for dynamic in (True, False):
                for bm, bn, bk, warps, stages in ((128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                                                  (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)):
                    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))

                    def launch() -> None:
                        _fp8_linear_kernel[grid](x, wq, ws, bias, y, m, n, k, DYNAMIC=dynamic, HAS_BIAS=True,
                                                 EMULATE_ROUNDING=False, PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn,
                                                 BLOCK_K=bk, num_warps=warps, num_stages=stages)

                    try:
                        configs[f"{'dynamic' if dynamic else 'weights'} {bm}x{bn}x{bk} w{warps} s{stages}"] = _ms(launch)
                    except Exception as exc:  # noqa: BLE001 - out of shared memory for this config
                        configs[f"{'dynamic' if dynamic else 'weights'} {bm}x{bn}x{bk} w{warps} s{stages}"] = f"{type(exc).__name__}"  # type: ignore[assignment]
            row["sweep_ms"] = configs
        out[label] = row
    return out


def bench_attention(sweep: bool) -> dict[str, Any]:
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fv_kernel.compute.fp8_attention import fp8_attention_triton, quantize_blocks
    from fv_kernel.compute.fp8_triton import _fp8_attention_kernel

    b, h, length, d = 1, 12, 32760, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(b, h, length, d, device="cuda", generator=g).bfloat16() for _ in range(3))
    flops = 4 * b * h * length * length * d
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v)
        cudnn = _ms(lambda: F.scaled_dot_product_attention(q, k, v))
    exact = F.scaled_dot_product_attention(q[:, :2, :4096].float(), k[:, :2].float(), v[:, :2].float())
    fp8 = _ms(lambda: fp8_attention_triton(q, k, v))
    got = fp8_attention_triton(q, k, v)
    out: dict[str, Any] = {
        "shape": [b, h, length, d], "sdpa_cudnn bf16 ms": cudnn, "fp8 triton ms (incl. K/V quant)": fp8,
        "tflops": {"cudnn": flops / cudnn / 1e9, "fp8": flops / fp8 / 1e9},
        "rel_err fp8 vs fp32 (2 heads, 4096 queries)": _rel(got[:, :2, :4096], exact),
        "rel_err cudnn bf16 vs fp32": _rel(ref[:, :2, :4096], exact),
    }
    if sweep:
        configs: dict[str, Any] = {}
        bh = b * h
        for bm, bn, warps, stages in ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)):
            kq, ks = quantize_blocks(k.reshape(bh, length, d).float(), bn)
            vt = (v.reshape(bh, length, d).float() / 1.0).to(torch.float8_e4m3fn).transpose(1, 2).contiguous()
            vs = torch.ones(bh, d, device="cuda")
            o = torch.empty_like(q)
            kq = kq.contiguous()

            def launch() -> None:
                _fp8_attention_kernel[(triton.cdiv(length, bm), bh)](
                    q, kq, ks, vt, vs, o, length, length, d, ks.shape[1], d**-0.5, EMULATE_ROUNDING=False,
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, num_warps=warps, num_stages=stages)

            try:
                configs[f"{bm}x{bn} w{warps} s{stages}"] = _ms(launch)
            except Exception as exc:  # noqa: BLE001
                configs[f"{bm}x{bn} w{warps} s{stages}"] = type(exc).__name__
        out["kernel-only sweep ms"] = configs
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sweep", action="store_true", help="also time several block-size configurations")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "linear": bench_linear(args.sweep), "attention": bench_attention(args.sweep)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
