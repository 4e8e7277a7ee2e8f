"""CUDA probe: the fused Wan 2.1 VAE decode with its convs' biases added by ``FusedOps.channel_bias_add_`` against
the same decode with PyTorch adding them (cuDNN's bias-free conv, then a broadcast add), in one process.

    python bench/probe_vae_bias.py [--latent 21 60 104] [--iters 3]

Random weights, bf16, the 81-frame latent 21x60x104 (480x832) by default. Prints each path's median ms and the
two videos' max abs difference (0: the same sums). docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fv_kernel.compute.fused import TritonFusedOps
from fv_wan.models import vae_blocks
from fv_wan.models.vae import WanVAE, WanVAEConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latent", type=int, nargs=3, default=(21, 60, 104), metavar=("T", "H", "W"))
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_vae_bias: needs CUDA; skipped")
        return 0
    torch.manual_seed(0)
    config = WanVAEConfig()
    vae = WanVAE(config).to("cuda", torch.bfloat16).eval()
    vae.set_fused_ops(TritonFusedOps())
    z = torch.randn(1, config.z_dim, *args.latent, device="cuda", dtype=torch.bfloat16)
    real_split = vae_blocks._splits_bias
    results = {}
    with torch.no_grad():
        for label, split in (("pytorch_bias_add", lambda *a: False), ("channel_bias_add_", real_split)):
            vae_blocks._splits_bias = split
            video = vae.decode(z)
            times = []
            for _ in range(args.iters):
                torch.cuda.synchronize()
                start = time.perf_counter()
                vae.decode(z)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            results[label] = (1000 * statistics.median(times), video)
    vae_blocks._splits_bias = real_split
    (before, a), (after, b) = results["pytorch_bias_add"], results["channel_bias_add_"]
    print(f"{torch.cuda.get_device_name()}: fused decode {'x'.join(map(str, args.latent))}, bf16: PyTorch's bias add "
          f"{before:.1f} ms, channel_bias_add_ {after:.1f} ms ({after / before:.3f}x); max abs diff "
          f"{float((a.float() - b.float()).abs().max()):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
