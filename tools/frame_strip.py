"""A PNG strip of a video's frames, for the README: every ``--every``-th frame, side by side, enlarged.

    fv generate --prompt "a red circle moves left quickly on a navy background" --seed 0 --output demo.pt
    python tools/frame_strip.py demo.pt docs/images/wan-toy-demo.png --every 2 --scale 2

The input is what ``fv generate --output X.pt`` writes: frames (F, 3, H, W) in [0, 1].
"""

from __future__ import annotations

import argparse
import sys

from pathlib import Path

import torch
import torch.nn.functional as F

from fv_kernel.api import encode_png


def strip(frames: torch.Tensor, every: int, scale: int) -> torch.Tensor:
    """Frames (F, 3, H, W) in [0, 1] -> one (3, H', W' * n) frame of frames 0, every, 2*every, ... left to right."""
    chosen = frames[::every].float().clamp(0, 1)
    if scale > 1:
        chosen = F.interpolate(chosen, scale_factor=scale, mode="bilinear", align_corners=False).clamp(0, 1)
    return torch.cat(list(chosen), dim=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("video", help="a .pt file of frames (F, 3, H, W) in [0, 1], as fv generate writes")
    parser.add_argument("output", help="the PNG to write")
    parser.add_argument("--every", type=int, default=2, help="take every N-th frame (default 2)")
    parser.add_argument("--scale", type=int, default=2, help="enlarge each frame N times (default 2)")
    args = parser.parse_args()
    if args.every < 1 or args.scale < 1:
        raise SystemExit(f"--every and --scale must be at least 1, got {args.every} and {args.scale}")
    frames = torch.load(args.video, map_location="cpu")
    if not isinstance(frames, torch.Tensor) or frames.ndim != 4 or frames.shape[1] != 3:
        raise SystemExit(f"{args.video}: expected frames (F, 3, H, W), got {getattr(frames, 'shape', type(frames))}")
    Path(args.output).write_bytes(encode_png(strip(frames, args.every, args.scale)))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
