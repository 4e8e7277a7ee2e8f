"""Where one forward of wan-toy's DiT goes on the CPU (issue 36 §4: the main job's 25 CFG steps are 50 of them).

Times the toy transformer's forward at the card's default request (17 frames at 64x64: 5 x 8 x 8 = 320
tokens, 24 text tokens) in fp32, then profiles five forwards and prints torch's op table, and the
matmuls' FLOP rate (their FLOPs counted from the config).

    python bench/profile_toy_forward.py [--iters 20] [--out out/toy_forward.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py, beside this script

from timing import timed_calls_ms


def linear_flops(config, tokens: int, text_tokens: int) -> int:  # type: ignore[no-untyped-def]
    """Multiply-adds x 2 of a forward's block linears (self q/k/v/o, cross q/o and k/v, the FFN)."""
    dim, ffn = config.inner_dim, config.ffn_dim
    per_block = 4 * tokens * dim * dim + 2 * tokens * dim * dim + 2 * text_tokens * config.text_dim * dim \
        + 2 * tokens * dim * ffn
    return 2 * config.num_layers * per_block


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from fv_wan.models.transformer import WanTransformer
    from fv_wan.toy_card import TOY_CONTEXT_LENGTH, TOY_TRANSFORMER

    torch.manual_seed(0)
    model = WanTransformer(TOY_TRANSFORMER).eval().requires_grad_(False)
    latents = torch.randn(1, 16, 5, 16, 16)
    timestep, context = torch.tensor([500.0]), torch.randn(1, TOY_CONTEXT_LENGTH, TOY_TRANSFORMER.text_dim)
    with torch.inference_mode():
        for _ in range(3):
            model(latents, timestep, context)
        ms = statistics.median(timed_calls_ms(lambda: model(latents, timestep, context), torch.device("cpu"), args.iters))
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                model(latents, timestep, context)
    table = prof.key_averages()
    addmm_ms = sum(e.self_cpu_time_total for e in table if e.key == "aten::addmm") / 5 / 1e3
    total_ms = sum(e.self_cpu_time_total for e in table) / 5 / 1e3
    flops = linear_flops(TOY_TRANSFORMER, 5 * 8 * 8, TOY_CONTEXT_LENGTH)
    result = {"threads": torch.get_num_threads(), "forward_ms_median": round(ms, 2),
              "profiled_forward_ms": round(total_ms, 2), "addmm_ms": round(addmm_ms, 2),
              "linear_gflops_per_forward": round(flops / 1e9, 3), "addmm_gflop_per_s": round(flops / addmm_ms / 1e6, 1)}
    print(table.table(sort_by="self_cpu_time_total", row_limit=12))
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
