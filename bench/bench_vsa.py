"""fv's ``vsa`` attention driver against dense cuDNN SDPA and FastVideo's Triton VSA, one layer's
self-attention at FastWan's shape (issue 19 §1). Figures: docs/benchmarks.md.

    python bench/bench_vsa.py --json vsa.json      # needs CUDA; prints why and exits 0 without

Shape: 448x832x61 -> a 16x28x52 token grid (23,296 tokens, exactly 364 tiles of 4x4x4),
12 heads x 128, bf16, random q/k/v/gate. For each sparsity (0.8, 0.9) it times, with
``triton.testing.do_bench``, in the same run:

- ``ms``: fv's driver end to end (:func:`vsa_triton`: raster-layout tile means, tile-level
  attention and top-k, the block-sparse kernel with the gated combine fused), on contiguous
  (B, H, L, D) inputs; ``model_layout_ms`` the same on the (B, L, H, D)-transposed views the Wan
  model passes; ``graph_ms`` the driver replayed as a CUDA graph (no host launch cost, as under
  the ``graphs`` tier); ``fused_kernel_ms_<warps>w<stages>s`` its block-sparse + combine kernel
  alone at each of ``LAUNCH_CONFIGS`` (the driver's first), ``tile_means_ms`` its one q/k/v
  tile-mean launch, ``select_ms`` its tile-level attention and top-k (torch);
- ``partitioned_ms``: the previous Triton path (tile partition copies of q/k/v/gate, its
  block-sparse kernel, the combine and un-tiling in torch), and ``partitioned_kernel_ms`` its
  block-sparse kernel alone;
- dense cuDNN SDPA, and, when ``fastvideo_kernel`` imports, FastVideo's ``ops.video_sparse_attn``
  with ``FASTVIDEO_VSA_TRITON=1`` on the same tiles (given pre-tiled inputs, as its model tiles
  once per forward; fv's figures include all layout work), eagerly and, where it captures, as a
  CUDA graph (``fastvideo_graph_ms``).

Parity: fv's output against FastVideo's (max abs and relative error), against the partitioned
path, and against fv's own fp32 torch reference on a 4,096-token crop (the dense masked reference
does not fit at full size).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

from fv_kernel.compute.video_sparse_attention import (
    VideoSparseAttention,
    _attend_tiles,
    block_sparse_attention_raster,
    block_sparse_attention_triton,
    select_tiles,
    selected_tile_count,
    tile_means_raster_stacked,
    tile_means_triton,
    tile_partition,
    vsa_forward,
    vsa_reference,
)

GRID = (16, 28, 52)
TILE = (4, 4, 4)
HEADS, DIM = 12, 128
#: (num_warps, num_stages) launches of the fused kernel timed alone; the first is what the driver uses.
LAUNCH_CONFIGS = ((4, 3), (4, 2), (4, 4), (8, 2), (8, 3))
CROP = (4, 16, 64)  # 4,096 tokens: the fp32 dense masked reference fits


def _bench(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def _graph_ms(fn: Any) -> float | None:
    """``fn`` captured as a CUDA graph and timed on replay; None when it cannot be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # host syncs or CPU work inside fn
        print(f"could not capture {getattr(fn, '__name__', fn)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return _bench(graph.replay)


def _fastvideo(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, sparsity: float) -> Any:
    """FastVideo's VSA on the tiled layout, or None when its package does not import."""
    os.environ.setdefault("FASTVIDEO_VSA_TRITON", "1")
    try:
        from fastvideo_kernel.ops import video_sparse_attn
    except Exception as exc:  # not installed, or its extension fails to load
        print(f"fastvideo_kernel not importable ({type(exc).__name__}: {exc}); its column is empty", file=sys.stderr)
        return None
    tq, tk, tv, tg = (tile_partition(t, GRID, TILE).tiles.flatten(2, 3).contiguous() for t in (q, k, v, gate))
    tiles = tq.shape[2] // 64
    sizes = torch.full((tiles,), 64, dtype=torch.int32, device=q.device)
    topk = selected_tile_count(tiles, sparsity)

    def run() -> torch.Tensor:
        return video_sparse_attn(tq, tk, tv, sizes, sizes, topk, block_size=TILE, compress_attn_weight=tg)

    return run, tiles


def _same_selection(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, sparsity: float,
                    fv_selected: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    """Where fv and FastVideo differ: the top-k choice or the attention math.

    FastVideo pools and scores the tiles in bf16, fv in fp32, so near-tied tiles can be chosen
    differently, and one different tile moves a whole query tile's output. Reported: the share
    of fv's (query tile, key tile) choices FastVideo also made, and fv's fused kernel run on
    FastVideo's own choice and compressed output, against FastVideo's result (the math alone).
    """
    from fastvideo_kernel.ops import fused_block_mean, fused_topk_mask

    tq, tk, tv = (tile_partition(t, GRID, TILE).tiles.flatten(2, 3).contiguous() for t in (q, k, v))
    tiles = tq.shape[2] // 64
    sizes = torch.full((tiles,), 64, dtype=torch.int32, device=q.device)
    q_c, k_c, v_c = (fused_block_mean(t, sizes, 64) for t in (tq, tk, tv))
    scores = torch.matmul(q_c, k_c.transpose(-2, -1)) / DIM**0.5
    compressed = torch.matmul(torch.softmax(scores, dim=-1), v_c)
    keep = selected_tile_count(tiles, sparsity)
    mask = fused_topk_mask(scores, keep)
    agreement = float(mask.gather(-1, fv_selected).float().mean())
    their_selected = mask.float().topk(keep, dim=-1).indices
    ours = block_sparse_attention_raster(q, k, v, grid=GRID, tile=TILE, selected=their_selected, compressed=compressed.float(),
                                         gate=gate, scale=DIM**-0.5)
    ours = tile_partition(ours, GRID, TILE).tiles.flatten(2, 3).float()
    return {"selection_agreement_with_fastvideo": agreement,
            "rel_vs_fastvideo_same_selection": float((ours - theirs.float()).norm() / theirs.float().norm()),
            "max_abs_vs_fastvideo_same_selection": float((ours - theirs.float()).abs().max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_vsa needs a CUDA device; nothing measured", file=sys.stderr)
        return 0
    from fv_kernel.compute.fused import triton_available

    if not triton_available():
        print("bench_vsa needs triton; nothing measured", file=sys.stderr)
        return 0
    torch.manual_seed(0)
    length, scale = math.prod(GRID), DIM**-0.5
    q, k, v, gate = (torch.randn(1, HEADS, length, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    # The Wan model's layout: (B, L, H, D) activations handed over as (B, H, L, D) views.
    mq, mk, mv, mg = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, gate))
    rows: list[dict[str, Any]] = []
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        dense_ms = _bench(lambda: F.scaled_dot_product_attention(q, k, v))
    rows.append({"case": "dense cuDNN SDPA", "ms": dense_ms})
    for sparsity in (0.8, 0.9):
        driver = VideoSparseAttention(sparsity, TILE, "triton")
        fv_out = driver.attend_video(q, k, v, grid=GRID, gate=gate)
        row: dict[str, Any] = {"case": f"fv vsa {sparsity}", "ms": _bench(lambda: driver.attend_video(q, k, v, grid=GRID, gate=gate))}
        row["model_layout_ms"] = _bench(lambda: driver.attend_video(mq, mk, mv, grid=GRID, gate=mg))
        row["graph_ms"] = _graph_ms(lambda: driver.attend_video(q, k, v, grid=GRID, gate=gate))
        means = tile_means_raster_stacked([q, k, v], GRID, TILE)
        row["select_ms"] = _bench(lambda: _attend_tiles(*means, sparsity, scale))
        tq, tk, tv = (tile_partition(t, GRID, TILE) for t in (q, k, v))
        compressed, selected = select_tiles(tq, tk, tv, sparsity, scale, tile_means_triton)
        for warps, stages in LAUNCH_CONFIGS:  # the first is the driver's; the rest, for tuning it
            row[f"fused_kernel_ms_{warps}w{stages}s"] = _bench(lambda: block_sparse_attention_raster(
                q, k, v, grid=GRID, tile=TILE, selected=selected, compressed=compressed, gate=gate, scale=scale,
                num_warps=warps, num_stages=stages))
        row["tile_means_ms"] = _bench(lambda: tile_means_raster_stacked([q, k, v], GRID, TILE))

        def partitioned() -> torch.Tensor:
            return vsa_forward(q, k, v, grid=GRID, gate=gate, sparsity=sparsity, tile=TILE,
                               sparse_branch=block_sparse_attention_triton, pool=tile_means_triton)

        row["partitioned_ms"] = _bench(partitioned)
        row["partitioned_kernel_ms"] = _bench(
            lambda: block_sparse_attention_triton(tq.tiles, tk.tiles, tv.tiles, tq.valid, selected, scale)
        )
        old = partitioned().float()
        row["max_abs_vs_partitioned"] = float((fv_out.float() - old).abs().max())
        reference = _fastvideo(q, k, v, gate, sparsity)
        if reference is not None:
            run, _ = reference
            theirs = run()
            ours = tile_partition(fv_out, GRID, TILE).tiles.flatten(2, 3)
            row["fastvideo_ms"] = _bench(run)
            row["fastvideo_graph_ms"] = _graph_ms(run)
            row["max_abs_vs_fastvideo"] = float((ours.float() - theirs.float()).abs().max())
            row["rel_vs_fastvideo"] = float((ours.float() - theirs.float()).norm() / theirs.float().norm())
            row.update(_same_selection(q, k, v, gate, sparsity, selected, theirs))
        cq, ck, cv, cg = (t[:, :, : math.prod(CROP)].float() for t in (q, k, v, gate))
        ref = vsa_reference(cq, ck, cv, grid=CROP, gate=cg, sparsity=sparsity, tile=TILE)
        got = driver.attend_video(cq.bfloat16(), ck.bfloat16(), cv.bfloat16(), grid=CROP, gate=cg.bfloat16())
        row["rel_vs_fp32_reference_crop"] = float((got.float() - ref).norm() / ref.norm())
        rows.append(row)
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"grid": GRID, "heads": HEADS, "head_dim": DIM, "device": torch.cuda.get_device_name(), "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
