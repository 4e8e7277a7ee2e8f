"""Parallel speed-ups on 2 GPUs: Wan DiT sp=2 and cfgp=2, and the vae=2 decode, over the same code on one GPU.

Random weights at real sizes, bf16, the fv code paths the plans run (``fv_wan.parallel``:
the sequence-parallel forward and the CFG-parallel DiT op; ``fv_wan.parallel_vae``: the
row-strip decode op). Each figure is the single-GPU time of the same code divided by the
2-GPU time, measured in the same run (CUDA events on rank 0, after warm-up, median of
``--iters``):

- ``dit_1.3b_sp2``: Wan2.1-1.3B, one denoise forward at 480x832x81 (32,760 tokens);
- ``dit_1.3b_cfgp2``: the same with CFG (two rows: two forwards on one GPU, one per GPU);
- ``dit_14b_sp2``: Wan2.1-14B at 720x1280x81 (75,600 tokens);
- ``vae_decode_vae2``: the Wan 2.1 VAE decoding 81 frames (21 latent frames) at 480x832.

Run on a host with 2 GPUs::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 bench/bench_parallel.py --out parallel.json

Without two CUDA devices it prints why and exits 0 (``skipped``). ``--smoke`` runs the
same code on CPU with gloo at tiny sizes (2 processes: ``torchrun --nproc-per-node 2
bench/bench_parallel.py --smoke``) to check the script end to end; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TARGETS = {"dit_1.3b_sp2": 1.8, "dit_1.3b_cfgp2": 1.85, "dit_14b_sp2": 1.9, "vae_decode_vae2": 1.6}


def _timed(fn: Callable[[], Any], *, warmup: int, iters: int, cuda: bool) -> float:
    """Median seconds of ``fn`` (every rank runs it; collectives inside keep them in step)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _transformer(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from fv_wan.models.transformer import WanTransformer, cast_for_inference

    torch.manual_seed(0)  # the same random weights on every rank
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the compute dtype: no full-size fp32 copy of 14B
    try:
        with torch.device(device):
            model = WanTransformer(config)
    finally:
        torch.set_default_dtype(previous)
    model.rope.build_tables(device)
    return cast_for_inference(model, dtype).eval()


def _dit_inputs(config: Any, latent: tuple[int, int, int], rows: int, device: torch.device, dtype: torch.dtype,
                text_tokens: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    frames, height, width = latent
    x = torch.randn(1, config.in_channels, frames, height, width, generator=generator).expand(rows, -1, -1, -1, -1)
    context = torch.randn(rows, text_tokens, config.text_dim, generator=generator)
    return {"x": x.to(device, dtype), "t": torch.full((rows,), 500.0, device=device),
            "context": context.to(device, dtype)}


def bench_dit(name: str, config: Any, latent: tuple[int, int, int], *, cfg: bool, args: argparse.Namespace,
              device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from fv_kernel.parallel import ParallelPlan, compile_mesh
    from fv_wan.parallel import _sp_forward, parallel_dit_op

    model = _transformer(config, device, dtype)
    rows = 2 if cfg else 1
    inputs = _dit_inputs(config, latent, rows, device, dtype, args.text_tokens)
    plan = ParallelPlan(cfgp=2) if cfg else ParallelPlan(sp=2)
    runtime = compile_mesh(plan, device.type)
    with torch.inference_mode():
        def single() -> Any:  # one GPU: the rows one after another (the cards' sequential CFG dispatch)
            return [model(inputs["x"][i : i + 1], inputs["t"][i : i + 1], inputs["context"][i : i + 1]) for i in range(rows)]

        if cfg:
            op = parallel_dit_op("transformer", model, runtime)

            def parallel() -> Any:
                return op.fn(inputs, {"dispatch": "sequential"})
        else:
            def parallel() -> Any:
                return _sp_forward(model, runtime, inputs["x"], inputs["t"], inputs["context"], None)

        # Numerics first: the plan's output against the single-GPU one.
        reference = torch.cat(single()).float()
        got = parallel()
        got = (got["v"] if isinstance(got, dict) else got).float()
        max_diff = float((got - reference).abs().max())
        one = _timed(single, warmup=args.warmup, iters=args.iters, cuda=device.type == "cuda")
        two = _timed(parallel, warmup=args.warmup, iters=args.iters, cuda=device.type == "cuda")
    tokens = latent[0] * (latent[1] // 2) * (latent[2] // 2)
    return {"name": name, "plan": plan.label(), "tokens": tokens, "rows": rows, "single_s": one, "parallel_s": two,
            "speedup": one / two, "max_abs_diff_vs_single": max_diff}


def bench_vae(config: Any, latent: tuple[int, int, int], *, args: argparse.Namespace, device: torch.device,
              dtype: torch.dtype) -> dict[str, Any]:
    from fv_kernel.parallel import ParallelPlan, compile_mesh
    from fv_wan.models.vae import WanVAE
    from fv_wan.parallel_vae import parallel_decode_op

    def build() -> Any:
        torch.manual_seed(2)
        with torch.device(device):
            return WanVAE(config).to(dtype).eval()

    whole_vae, split_vae = build(), build()
    runtime = compile_mesh(ParallelPlan(sp=2, vae=2), device.type)
    split = parallel_decode_op(split_vae, runtime)
    frames, height, width = latent
    z = torch.randn(1, config.z_dim, frames, height, width, generator=torch.Generator().manual_seed(3)).to(device)

    def stream(step: Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]]) -> torch.Tensor:
        cache: dict[str, torch.Tensor] = {}
        out = []
        for index in range(frames):
            result = step({"z": z[:, :, index : index + 1], **{f"cache.{k}": v for k, v in cache.items()}},
                          {"last": index == frames - 1})
            cache = {k[len("cache."):]: v for k, v in result.items() if k.startswith("cache.")}
            out.append(result["frames"])
        return torch.cat(out, dim=2)

    def whole_step(inputs: dict[str, torch.Tensor], params: dict[str, Any]) -> dict[str, torch.Tensor]:
        from fv_wan.models.vae import CausalCache

        tensors = {k[len("cache."):]: v for k, v in inputs.items() if k.startswith("cache.")}
        cache = CausalCache.from_tensors(tensors) if tensors else whole_vae.new_decode_cache()
        z_frame = whole_vae.denormalize_latents(inputs["z"].float()).to(dtype)
        decoded, cache = whole_vae.decode_step(z_frame, cache)
        out = {"frames": (decoded.float() / 2 + 0.5).clamp(0, 1)}
        if not params["last"]:
            out.update({f"cache.{k}": v for k, v in cache.to_tensors().items()})
        return out

    with torch.inference_mode():
        reference = stream(whole_step)
        got = stream(split.fn)
        max_diff = float((got - reference).abs().max())
        one = _timed(lambda: stream(whole_step), warmup=1, iters=max(1, args.iters // 2), cuda=device.type == "cuda")
        two = _timed(lambda: stream(split.fn), warmup=1, iters=max(1, args.iters // 2), cuda=device.type == "cuda")
    return {"name": "vae_decode_vae2", "plan": "vae2", "latent": list(latent), "pixel_frames": int(reference.shape[2]),
            "single_s": one, "parallel_s": two, "speedup": one / two, "max_abs_diff_vs_single": max_diff}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (rank 0)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny sizes: checks the script, times mean nothing")
    parser.add_argument("--only", nargs="*", default=None, help=f"a subset of {sorted(TARGETS)}")
    args = parser.parse_args()

    if not args.smoke and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        print(json.dumps({"skipped": f"needs 2 CUDA GPUs (found {torch.cuda.device_count() if torch.cuda.is_available() else 0}); "
                                     "run it under torchrun --nproc-per-node 2 on a 2-GPU host"}))
        return 0
    if "WORLD_SIZE" not in os.environ:
        print("run it under torchrun --nproc-per-node 2 (see the module docstring)", file=sys.stderr)
        return 2

    import torch.distributed as dist
    from fv_wan.models.transformer import WanTransformerConfig
    from fv_wan.models.vae import WanVAEConfig

    if args.smoke:
        dist.init_process_group("gloo")
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
        small = WanTransformerConfig.tiny()
        cases = {
            "dit_1.3b_sp2": (small, (2, 8, 8), False),
            "dit_1.3b_cfgp2": (small, (2, 8, 8), True),
            "dit_14b_sp2": (small, (3, 8, 8), False),
        }
        vae_config, vae_latent = WanVAEConfig(base_dim=8, z_dim=16, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
                                              attn_scales=()), (3, 4, 6)
        args.text_tokens = 8
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
        cases = {
            "dit_1.3b_sp2": (WanTransformerConfig.wan21_t2v_1_3b(), (21, 60, 104), False),
            "dit_1.3b_cfgp2": (WanTransformerConfig.wan21_t2v_1_3b(), (21, 60, 104), True),
            "dit_14b_sp2": (WanTransformerConfig.wan21_t2v_14b(), (21, 90, 160), False),
        }
        vae_config, vae_latent = WanVAEConfig.wan21(), (21, 60, 104)
    if dist.get_world_size() != 2:
        raise SystemExit(f"needs exactly 2 ranks, got {dist.get_world_size()}")
    wanted = set(args.only or TARGETS)
    results = []
    for name, (config, latent, cfg) in cases.items():
        if name in wanted:
            results.append(bench_dit(name, config, latent, cfg=cfg, args=args, device=device, dtype=dtype))
            if device.type == "cuda":  # the model of the case just run is gone: give its memory back
                torch.cuda.empty_cache()
    if "vae_decode_vae2" in wanted:
        results.append(bench_vae(vae_config, vae_latent, args=args, device=device, dtype=dtype))
    if dist.get_rank() == 0:
        for row in results:
            row["target"] = TARGETS[row["name"]]
            print(f"{row['name']:>16}: {row['single_s'] * 1e3:9.1f} ms on 1 -> {row['parallel_s'] * 1e3:9.1f} ms on 2 "
                  f"= {row['speedup']:.2f}x (target {row['target']}x), max |diff| vs 1 GPU {row['max_abs_diff_vs_single']:.2e}")
        report = {
            "smoke": args.smoke, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()), "results": results,
        }
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
