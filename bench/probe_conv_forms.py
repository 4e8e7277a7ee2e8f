"""Whether a Wan VAE 3x3x3 conv runs faster written as 2D convs (issue 36 §2, the decode's slowest convs).

The decoder's 96-channel convs at full resolution ran at about 250 TFLOP/s in cuDNN's ``sm80_xmma``
3D kernel, against about 610 for its 192-channel ones at half resolution (docs/benchmarks.md). This
times one causal conv (time padding 2 already in the input, channels-last bf16) at each stage's
shape in four forms, and each form's largest difference from the 3D conv:

- ``conv3d``: ``F.conv3d`` (what fv runs);
- ``conv3d_benchmark``: the same under ``cudnn.benchmark`` (the algorithm picked by timing);
- ``taps_conv2d``: three ``F.conv2d`` over frame views (one per time tap, no copy: a channels-last
  3D tensor's frames are channels-last 2D images), summed in fp32;
- ``stacked_conv2d``: the three time taps concatenated on channels (a copy), one ``F.conv2d``.

    python bench/probe_conv_forms.py out/conv_forms.json     # CUDA only; prints "skipped" without
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py, beside this script

from timing import timed_calls_ms


def _time(fn, iters: int = 10) -> float:
    """Median ms of ``fn`` after three warm-up calls (CUDA events, ``timing.py``)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return statistics.median(timed_calls_ms(fn, torch.device("cuda"), iters))


def _forms(x: torch.Tensor, weight: torch.Tensor) -> dict[str, callable]:
    frames_out = x.shape[2] - 2
    taps = [weight[:, :, k].contiguous(memory_format=torch.channels_last) for k in range(3)]
    stacked_weight = torch.cat(taps, dim=1).contiguous(memory_format=torch.channels_last)

    def frames(t0: int) -> torch.Tensor:  # (frames_out, C, H, W) channels-last view of x's frames t0..
        return x[0, :, t0:t0 + frames_out].transpose(0, 1)

    def conv3d() -> torch.Tensor:
        return F.conv3d(x, weight, None, 1, (0, 1, 1))

    def taps_conv2d() -> torch.Tensor:
        acc = F.conv2d(frames(0), taps[0], None, 1, 1).float()
        acc += F.conv2d(frames(1), taps[1], None, 1, 1)
        acc += F.conv2d(frames(2), taps[2], None, 1, 1)
        return acc.to(x.dtype)

    def stacked_conv2d() -> torch.Tensor:
        stacked = torch.cat([frames(0), frames(1), frames(2)], dim=1).contiguous(memory_format=torch.channels_last)
        return F.conv2d(stacked, stacked_weight, None, 1, 1)

    return {"conv3d": conv3d, "taps_conv2d": taps_conv2d, "stacked_conv2d": stacked_conv2d}


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_conv_forms: no CUDA device; skipped")
        return 0
    out: dict[str, dict[str, float]] = {}
    for channels, height, width in ((96, 480, 832), (192, 240, 416), (384, 120, 208)):
        weight = torch.randn(channels, channels, 3, 3, 3, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, channels, 6, height, width, device="cuda", dtype=torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last_3d)
        flops = 2 * channels * channels * 27 * 4 * height * width
        forms = _forms(x, weight)
        reference = forms["conv3d"]().float()
        for name, fn in forms.items():
            ms = _time(fn)
            y = fn().float().reshape(reference.shape) if name == "conv3d" else fn().float().transpose(0, 1).unsqueeze(0)
            diff = float((y - reference).abs().max())
            out[f"c{channels}_{name}"] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "max_abs_vs_conv3d": diff}
            print(channels, name, round(ms, 3), "ms", round(flops / ms / 1e9), "TFLOP/s", "max abs", diff, flush=True)
        with torch.backends.cudnn.flags(enabled=True, benchmark=True):
            for name in ("conv3d", "taps_conv2d"):
                ms = _time(forms[name])
                out[f"c{channels}_{name}_benchmark"] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
                print(channels, name, "benchmark", round(ms, 3), "ms", round(flops / ms / 1e9), "TFLOP/s", flush=True)
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out/conv_forms.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
