"""How a Wan VAE 3D conv's time depends on the width it runs at (halo tiles give odd widths, issue 36 §2).

Times the decoder's stage convs (channels-last bf16, causal time padding of 2 already in the input) at the
full 832-pixel width, at half, and at the widths a 1x2 and 1x3 halo tiling gives them, and reports
microseconds per output pixel column, so a width the conv kernels handle badly stands out.

    python bench/probe_conv_widths.py out/conv_widths.json     # CUDA only; prints "skipped" without
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def _time(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_conv_widths: no CUDA device; skipped")
        return 0
    out: dict[str, dict[str, float]] = {}
    # (channels, frames out, height, widths): stage 3 at 480 rows, stage 2 at 240 rows.
    for channels, height, widths in ((96, 480, (832, 416, 423, 424, 432, 284, 288)), (192, 240, (416, 208, 218, 224, 146, 152))):
        weight = torch.randn(channels, channels, 3, 3, 3, device="cuda", dtype=torch.bfloat16) * 0.02
        for width in widths:
            x = torch.randn(1, channels, 6, height, width, device="cuda", dtype=torch.bfloat16)
            x = x.contiguous(memory_format=torch.channels_last_3d)
            ms = _time(lambda: F.conv3d(x, weight, None, 1, (0, 1, 1)))
            out[f"c{channels}_h{height}_w{width}"] = {"ms": round(ms, 4), "us_per_column": round(1000 * ms / width, 3)}
            print(channels, height, width, round(ms, 3), "ms", round(1000 * ms / width, 3), "us/column", flush=True)
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out/conv_widths.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
