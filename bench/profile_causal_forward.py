"""Where a realtime chunk's forward spends its time (issue 32): one causal Wan 1.3B forward at 480x832.

    python bench/profile_causal_forward.py out/causal_forward.json            # CUDA, bf16, random weights
    python bench/profile_causal_forward.py /tmp/cf.json --smoke               # wan-toy-causal on the CPU

It builds the card as ``bench_realtime.py`` does (seeded random weights at real size), then times
``causal_batch_forward`` on one chunk (3 latent frames, 4,680 tokens) over histories of 0 to 6 chunks (the
card's window: 7 slabs), the history held as per-layer tensors as the pool returns them; and runs one
full-window forward under torch.profiler, writing the kernels by device time beside the JSON
(``causal_forward_kernels.txt``). Beside the measured times it prints the forward's matmul and attention FLOPs,
so each part's rate can be read against the GPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_realtime import CARD_1_3B as CARD, CARD_SMOKE as SMOKE, card_for  # noqa: E402  (the sessions' cards)

from fv_kernel.api import ComputeOptions, InstanceOptions, TaskType, build_instance  # noqa: E402
from fv_wan.models.causal_transformer import causal_batch_forward  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE} on the CPU at 64x64, fp32")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--fused-ops", default="off", choices=["off", "torch", "triton"])
    parser.add_argument("--attention-backend", default="sdpa")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(f"skipped: {CARD} at real size needs CUDA (run with --smoke for the CPU toy)")
        return 0
    device, precision, height, width = ("cpu", "fp32", 64, 64) if args.smoke else ("cuda", "bf16", 480, 832)
    card = card_for(args, batching=True)
    instance = build_instance(card, InstanceOptions(device=device, precision=precision, attention_backend=args.attention_backend,
                                                    compute=ComputeOptions(fused_ops=args.fused_ops)))
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    model = instance.components["transformer"]
    config = model.config
    loop = next(spec for spec in card.loops.values() if "local_chunks" in spec.config)
    frames, local = int(loop.config.get("frames_per_chunk", 3)), int(loop.config["local_chunks"])
    p_h, p_w = config.patch_size[1], config.patch_size[2]
    h, w = height // 8, width // 8
    tokens = frames * (h // p_h) * (w // p_w)
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    ref = next(model.parameters())
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=ref.dtype)

    latents = randn(1, config.in_channels, frames, h, w)
    context = randn(1, 512, config.text_dim)
    timestep = torch.tensor([750.0], device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def forward(history: list[tuple[torch.Tensor, torch.Tensor]] | None, start: int) -> None:
        with torch.no_grad():
            causal_batch_forward(model, latents, timestep, context, start_frames=[start], histories=[history])

    results: dict[str, Any] = {"card": SMOKE if args.smoke else CARD, "device": device, "precision": precision,
                               "tokens_per_chunk": tokens, "window_chunks": local, "fused_ops": args.fused_ops,
                               "attention_backend": args.attention_backend,
                               "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "by_history": {}}
    matmul_params = sum(p.numel() for name, p in model.blocks.named_parameters() if p.dim() == 2)
    for chunks in range(local):
        keys = chunks * tokens
        history = [(randn(1, keys, heads, head_dim), randn(1, keys, heads, head_dim)) for _ in range(config.num_layers)]
        start = chunks * frames
        forward(history, start)
        times = []
        for _ in range(args.iters):
            sync()
            t0 = time.perf_counter()
            forward(history, start)
            sync()
            times.append(time.perf_counter() - t0)
        attention_flops = 4 * tokens * (keys + tokens) * heads * head_dim * config.num_layers
        results["by_history"][chunks] = {
            "keys": keys + tokens, "median_ms": 1000 * statistics.median(times),
            "attention_tflop": attention_flops / 1e12, "matmul_tflop": 2 * tokens * matmul_params / 1e12,
        }
        print(f"history {chunks} chunks ({keys + tokens} keys): {results['by_history'][chunks]['median_ms']:.1f} ms "
              f"(self-attention {attention_flops / 1e12:.1f} TFLOP, matmuls {2 * tokens * matmul_params / 1e12:.1f} TFLOP)",
              flush=True)
        if chunks == local - 1 and device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                forward(history, start)
                sync()
            table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_name("causal_forward_kernels.txt").write_text(table + "\n")
            events = prof.key_averages()
            total = sum(e.self_device_time_total for e in events)

            def share(*words: str) -> float:
                return sum(e.self_device_time_total for e in events if any(wd in e.key.lower() for wd in words)) / 1000

            results["profile_ms"] = {"total": total / 1000, "attention": share("attention", "fmha", "flash", "sdpa"),
                                     "gemm": share("gemm", "nvjet", "cutlass", "sm90_xmma", "splitk")}
            print(f"profiled full-window forward: {results['profile_ms']}", flush=True)
        del history
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
