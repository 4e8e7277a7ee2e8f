"""What the decode loop's steps cost against one ``WanVAE.decode`` call (issue 19 §1, fastwan end to end).

A video request decodes one latent frame per WorkUnit (fv-wan's ``vae_decode_frame`` op), and
the Engine waits for the device after every batch. This script decodes the same latent five
ways, each with the device synchronised where the Engine would, and reports the median wall
time of each and the largest difference of its video to the one-call decode (all exact: 0):

- ``decode``: ``WanVAE.decode`` in one call;
- ``steps``: ``WanVAE.decode_step`` per latent frame, synchronised after each;
- ``op``: the op per latent frame, its history handed back as it is (what it does);
- ``op_packed``: the same with the history packed contiguous after every step (what the op did
  until 2026-12-02: every channels-last slot copied out, and back into the conv buffers);
- ``op_checked``: ``op`` plus the Engine's NaN/Inf check of every output after every step.

On CUDA: the real Wan 2.1 VAE with random weights at fastwan's latent (16x56x104: 61 frames at
448x832), bf16, fused Triton norm + SiLU. ``--smoke`` runs a tiny VAE on the CPU (times mean
nothing; the exactness is checked).

    python bench/bench_decode_op.py --json decode_op.json             # on a CUDA machine
    python bench/bench_decode_op.py --smoke --json /tmp/decode_op.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

import torch

from bench_vae_decode import SMOKE_CONFIG, random_decoder  # bench/, beside this script
from fv_kernel.compute.fused import TritonFusedOps
from fv_kernel.loop.plan import StepResult
from fv_kernel.runtime.executor import check_finite
from fv_wan.instance import wan_ops
from fv_wan.models.vae import WanVAE, WanVAEConfig

ROWS = ("decode", "steps", "op", "op_packed", "op_checked")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _paths(vae: WanVAE, z: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each row's decode of ``z`` to (B, 3, F, H, W) in [0, 1], fp32."""
    device = z.device
    op = wan_ops(types.SimpleNamespace(components={"vae_decoder": vae}))["vae_decode_frame"]
    raw = vae.denormalize_latents(z.float()).to(z.dtype)
    unit = [types.SimpleNamespace(plan=types.SimpleNamespace(op="vae_decode_frame", loop_id="decode", step_index=0))]

    def to_video(x: torch.Tensor) -> torch.Tensor:
        return (x.float() / 2 + 0.5).clamp(0, 1)

    def steps() -> torch.Tensor:
        cache, frames = vae.new_decode_cache(), []
        for k in range(z.shape[2]):
            out, cache = vae.decode_step(raw[:, :, k : k + 1], cache)
            frames.append(to_video(out))
            _sync(device)
        return torch.cat(frames, dim=2)

    def through_op(pack: bool = False, check: bool = False) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            history: dict[str, torch.Tensor] = {}
            frames = []
            for k in range(z.shape[2]):
                inputs = {"z": z[:, :, k : k + 1], **{f"cache.{n}": v for n, v in history.items()}}
                out = op.fn(inputs, {"last": k == z.shape[2] - 1})
                if pack:
                    out = {n: v.contiguous() if n.startswith("cache.") else v for n, v in out.items()}
                _sync(device)
                if check:
                    check_finite([StepResult(outputs=out)], unit)  # type: ignore[arg-type]
                frames.append(out["frames"])
                history = {n[len("cache."):]: v for n, v in out.items() if n.startswith("cache.")}
            return torch.cat(frames, dim=2)

        return run

    return {"decode": lambda: to_video(vae.decode(raw)), "steps": steps, "op": through_op(),
            "op_packed": through_op(pack=True), "op_checked": through_op(check=True)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = WanVAEConfig.wan21() if device.type == "cuda" else SMOKE_CONFIG
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    latent = tuple(args.latent) if device.type == "cuda" else (3, 4, 6)
    vae = random_decoder(config, device, dtype)
    if device.type == "cuda":
        vae.set_fused_ops(TritonFusedOps())
    z = torch.randn(1, config.z_dim, *latent, generator=torch.Generator(device=device).manual_seed(4), device=device).to(dtype)
    iters = args.iters if device.type == "cuda" else 1
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "latent": "x".join(map(str, latent)), "dtype": str(dtype).removeprefix("torch."),
                           "torch": torch.__version__, "rows": {}}  # fmt: skip
    with torch.inference_mode():
        paths = _paths(vae, z)
        reference = paths["decode"]().cpu()
        for name in ROWS:
            video = paths[name]()  # warm-up, and the video compared
            _sync(device)
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                paths[name]()
                _sync(device)
                times.append((time.perf_counter() - start) * 1e3)
            out["rows"][name] = {"ms": round(statistics.median(times), 1),
                                 "max_abs_diff_vs_decode": float((video.cpu() - reference).abs().max())}
    decode_ms = out["rows"]["decode"]["ms"]
    for row in out["rows"].values():
        row["x_decode"] = round(row["ms"] / decode_ms, 3) if decode_ms else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="tiny VAE on the CPU (times mean nothing)")
    parser.add_argument("--latent", type=int, nargs=3, default=(16, 56, 104), metavar=("T", "H", "W"))
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_decode_op: no CUDA device; skipped (use --smoke for the CPU dry run)")
        return 0
    result = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
