"""GPU benchmark of fv's precision paths beside diffusers bf16 in one run (issue 34, docs/precision.md).

One Wan2.1-1.3B denoise step at 480x832x81 (32,760 tokens), batch 1, random weights, bf16: fv's
``WanTransformer`` on each precision path and diffusers' ``WanTransformer3DModel`` (the same
weights, bf16, SDPA) timed in the same process, each fv path as a ratio of the diffusers step:

- ``native``: bf16 linears, the native attention driver (``--attention``, SDPA-cuDNN by default);
- ``fp8_weights``: the fp8 target linears as ``Fp8Linear`` mode ``fp8_weights`` (e4m3 weights,
  per-channel scales; activations bf16);
- ``fp8_dynamic``: the targets as mode ``fp8_dynamic`` (cuBLASLt's rowwise-scaled e4m3 GEMM on Hopper:
  ``Fp8Linear``'s ``auto`` kernel), the activations quantized per token in the fused norm and GELU
  kernels that compute them (``FusedOps.*_fp8``), else (the attention outputs) by one Triton pass;
- ``fp8_dynamic_unfused_quantization``: the same, every linear quantizing its own bf16 input;
- ``fp8_attention``: bf16 linears, attention through the ``fp8`` driver;
- ``fp8_all``: ``fp8_dynamic`` and ``fp8_attention``.

The fp8 targets are what Wan cards name (q/k/v/o of attn1 and attn2 and the two FFN linears of every
block; embedders, modulation and proj_out stay bf16). Per path: step ms, the ratio to diffusers, the
weights' bytes, the step's peak allocated memory, and the step output's relative error and PSNR
against the native path (one step; full-trajectory PSNR is the parity contract's measurement).
``--with-14b`` adds Wan2.1-14B at 720x1280x81 (75,600 tokens) when the GPU has the memory;
``--models 14b`` runs that size alone (it takes most of one 10-minute device call; use ``--iters 2``).
One model is on the device at a time (the weights wait on the host between rows), so the 14B case
fits an 80 GB card.

    python bench/bench_precision.py bench/records/precision_h200 [--with-14b | --models 14b]
    python bench/bench_precision.py /tmp/p --smoke   # tiny config on CPU (fp32, torch kernels)

Without CUDA (and without ``--smoke``) it writes ``{"skipped": ...}`` and exits 0.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py, beside this script

from timing import timed_calls_ms

GiB = 2**30
PATHS = ("native", "fp8_weights", "fp8_dynamic", "fp8_dynamic_unfused_quantization", "fp8_attention", "fp8_all")
#: Wan's fp8 targets (fnmatch over the transformer's module names).
FP8_TARGETS = ("blocks.*.attn1.to_[qkv]", "blocks.*.attn1.to_out.0", "blocks.*.attn2.to_[qkv]",
               "blocks.*.attn2.to_out.0", "blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def attention_driver(name: str) -> Any:
    """The named driver through the kernel's registry, or from its manifest in a checkout run
    without reinstalled metadata."""
    try:
        from fv_kernel.plugins.registry import load_attention_backend

        return load_attention_backend(name)
    except Exception:  # noqa: BLE001 - not registered in this environment's metadata (or no plugin host)
        import yaml

        import fv_kernel
        from fv_kernel.card.refs import import_object

        manifest = yaml.safe_load((Path(fv_kernel.__file__).parent / "fv-plugin.yaml").read_text())
        targets = {e["name"]: e["target"] for e in manifest["contributions"]["attention_backends"]}
        return import_object(targets[name])()


def fp8_targets(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
            and any(fnmatch.fnmatchcase(name, pattern) for pattern in FP8_TARGETS)]


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter redrawn: N(0, 1/fan_in) for matrices, N(0, 0.02) for vectors."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            std = p[0].numel() ** -0.5 if p.dim() > 1 else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)


def psnr(a: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR of ``a`` against ``ref`` with the reference's peak-to-peak range as the signal."""
    mse = float((a.double() - ref.double()).pow(2).mean())
    peak = float(ref.double().max() - ref.double().min())
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.dtype = torch.float32 if args.smoke else torch.bfloat16
        self.iters = 1 if args.smoke else args.iters

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_step(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """Median ms of ``fn`` (after one warm-up) and its peak allocated memory (CUDA)."""
        fn()
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = timed_calls_ms(fn, self.device, self.iters)
        peak = torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None
        return {"ms": statistics.median(times), "ms_min": min(times), "iters": self.iters,
                "peak_gib": None if peak is None else round(peak / GiB, 3)}

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def unfused_quantization(fused: Any) -> Any:
    """``fused``'s ops, but every fp8 linear quantizing its own input (the norms and the GELU not writing e4m3
    rows): the fp8_dynamic path as it ran before the fused quantization, for the side-by-side row."""
    if fused is None:
        return None

    class EachLinearQuantizes(type(fused)):  # type: ignore[misc, valid-type]
        def takes_quantized_rows(self, *consumers: torch.nn.Module) -> bool:
            return False

    return EachLinearQuantizes()


def fv_model(config: Any, dtype: torch.dtype, device: torch.device, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """fv's transformer holding ``weights``, materialised straight at ``dtype`` (built on meta, so a
    14B model never exists in fp32 on the device beside another)."""
    from fv_wan.models.transformer import WanTransformer, cast_for_inference

    with torch.device("meta"):
        model = WanTransformer(config)
    model = cast_for_inference(model, dtype).to_empty(device=device)
    model.load_state_dict(weights, strict=True)
    model.rope.build_tables(device)
    return model.eval().requires_grad_(False)


def model_case(run: Run, label: str, config: Any, latent: tuple[int, int, int], text_len: int) -> dict[str, Any]:
    """Every path and diffusers for one model size; returns its rows.

    One model is on the device at a time: the weights are drawn once (on diffusers' twin, whose
    state-dict keys are fv's), kept on the host, and loaded into each row's model."""
    from fv_wan.models.transformer import cast_for_inference

    from fv_kernel.compute.attention_backends import attention_callable
    from fv_kernel.compute.fp8 import quantize_linears
    from fv_kernel.compute.fused import select_fused_ops

    device, dtype = run.device, run.dtype
    g = torch.Generator(device=device).manual_seed(1)
    f, h, w = latent
    inputs = (torch.randn(1, config.in_channels, f, h, w, generator=g, device=device).to(dtype),
              torch.rand(1, generator=g, device=device) * 1000,
              torch.randn(1, text_len, config.text_dim, generator=g, device=device).to(dtype))
    native_attention = run.args.attention if device.type == "cuda" else "sdpa"
    native_fn = attention_callable(attention_driver(native_attention))
    fp8_fn = attention_callable(attention_driver("fp8"))
    fused = select_fused_ops(device, "auto")  # Triton glue on CUDA (what fv runs), none on CPU
    out: dict[str, Any] = {"tokens": f * (h // 2) * (w // 2), "native_attention": native_attention,
                           "fused_ops": None if fused is None else fused.name, "rows": {}}

    from diffusers import WanTransformer3DModel

    log(f"[{label}] diffusers bf16")
    with torch.device(device):
        twin = WanTransformer3DModel(**config.to_diffusers_config())
    randomise_(twin, 0)
    twin = cast_for_inference(twin, dtype).eval().requires_grad_(False)
    weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in twin.state_dict().items()}
    run.free()
    twin_out: torch.Tensor | None = None
    try:
        with torch.no_grad():
            twin_out = twin(*inputs, return_dict=False)[0].float()
            timing = run.time_step(functools.partial(twin, *inputs, return_dict=False))
        out["rows"]["diffusers bf16"] = {**timing, "weight_bytes": weight_bytes(twin),
                                         "weight_gib": round(weight_bytes(twin) / GiB, 3)}
    except Exception as exc:  # noqa: BLE001 - recorded, the fv paths still run
        out["diffusers_error"] = f"{type(exc).__name__}: {exc}"[:500]
    del twin
    run.free()

    reference: torch.Tensor | None = None
    for path in PATHS:
        log(f"[{label}] {path}")
        mode = {"fp8_weights": "fp8_weights", "fp8_dynamic": "fp8_dynamic", "fp8_dynamic_unfused_quantization": "fp8_dynamic",
                "fp8_all": "fp8_dynamic"}.get(path)
        # A fresh module per row: the attention driver and fused ops set on one hold locks, and a
        # quantized copy beside the bf16 one would not fit at 14B.
        subject = fv_model(config, dtype, device, weights)
        if mode is not None:
            quantize_linears(subject, fp8_targets(subject), mode=mode)  # kernel="auto": cuBLASLt on Hopper
        subject.set_attention_fn(fp8_fn if path in ("fp8_attention", "fp8_all") else native_fn)
        subject.set_fused_ops(unfused_quantization(fused) if path == "fp8_dynamic_unfused_quantization" else fused)
        run.free()
        with torch.no_grad():
            y = subject(*inputs).float()
            timing = run.time_step(functools.partial(subject, *inputs))
        row = {**timing, "weight_bytes": weight_bytes(subject), "weight_gib": round(weight_bytes(subject) / GiB, 3)}
        if reference is None:
            reference = y
            if twin_out is not None:  # the same weights: fv native and diffusers agree to bf16 rounding
                out["rel_err_native_vs_diffusers"] = float((y.double() - twin_out.double()).norm() / twin_out.double().norm())
        else:
            row["rel_err_vs_native"] = float((y.double() - reference.double()).norm() / reference.double().norm())
            row["psnr_vs_native_db"] = round(psnr(y, reference), 2)
        if "diffusers bf16" in out["rows"]:
            row["ratio_vs_diffusers"] = round(row["ms"] / out["rows"]["diffusers bf16"]["ms"], 3)
        out["rows"][path] = row
        out.setdefault("fp8_targets", len(fp8_targets(subject)))  # the first row is native: its targets are linears
        del subject, y
        run.free()
    return out


def table(results: dict[str, Any]) -> str:
    lines = ["| model | path | step ms | vs diffusers bf16 | weights GiB | step peak GiB | rel err vs native | PSNR vs native dB |",
             "|---|---|---|---|---|---|---|---|"]
    for label, case in results.get("models", {}).items():
        for path, row in case.get("rows", {}).items():
            ratio = row.get("ratio_vs_diffusers")
            lines.append(
                f"| {label} | {path} | {row['ms']:.1f} | {'' if ratio is None else f'{ratio:.2f}x'} | "
                f"{row['weight_gib']:.3f} | {'' if row['peak_gib'] is None else row['peak_gib']} | "
                f"{row.get('rel_err_vs_native', ''):{'.2e' if 'rel_err_vs_native' in row else ''}} | "
                f"{row.get('psnr_vs_native_db', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="directory for results.json and table.md")
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU in fp32 (the CPU smoke test)")
    parser.add_argument("--with-14b", action="store_true", help="also Wan2.1-14B at 720x1280x81, if memory allows")
    parser.add_argument("--models", nargs="+", choices=["1.3b", "14b"], default=None,
                        help="which sizes to run (default: 1.3b, plus 14b with --with-14b); 14b alone fits one device call")
    parser.add_argument("--attention", default="sdpa_cudnn", help="the native path's attention driver (CUDA)")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "models": {}, "errors": {}}

    def write() -> None:
        (args.output / "results.json").write_text(json.dumps(results, indent=2, default=str))
        (args.output / "table.md").write_text(table(results) + "\n")

    if not args.smoke and not torch.cuda.is_available():
        results["skipped"] = "bench_precision needs CUDA (an sm_89+ GPU for the e4m3 kernels); --smoke runs on CPU"
        write()
        print(results["skipped"])
        return 0
    from fv_wan.models.transformer import WanTransformerConfig

    run = Run(args)
    results["env"] = {"device": torch.cuda.get_device_name() if run.device.type == "cuda" else "cpu",
                      "torch": torch.__version__}
    sizes = args.models or (["1.3b", "14b"] if args.with_14b else ["1.3b"])
    cases = []
    if "1.3b" in sizes or args.smoke:
        cases.append(("tiny (smoke)" if args.smoke else "wan2.1-1.3b 480x832x81",
                      WanTransformerConfig.tiny() if args.smoke else WanTransformerConfig.wan21_t2v_1_3b(),
                      (3, 8, 6) if args.smoke else (21, 60, 104), 10 if args.smoke else 512))
    if "14b" in sizes and not args.smoke:
        cases.append(("wan2.1-14b 720x1280x81", WanTransformerConfig.wan21_t2v_14b(), (21, 90, 160), 512))
    for label, config, latent, text_len in cases:
        if "14b" in label:
            free, _ = torch.cuda.mem_get_info()
            need = 60 * GiB  # diffusers' twin built in fp32 (57 GB) before its cast; then one bf16 model at a time
            if free < need:
                results["errors"][label] = f"skipped: {free / GiB:.0f} GiB free, about {need / GiB:.0f} GiB needed"
                continue
        started = time.perf_counter()
        try:
            results["models"][label] = model_case(run, label, config, latent, text_len)
            results["models"][label]["case_s"] = round(time.perf_counter() - started, 1)
        except Exception as exc:  # noqa: BLE001 - recorded; the other size still runs
            results["errors"][label] = f"{type(exc).__name__}: {exc}"[:2000]
        run.free()
        write()
    write()
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
