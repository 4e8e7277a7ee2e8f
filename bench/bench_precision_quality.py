"""What each fp8 precision path costs in quality over a whole trajectory (issue 34, the quality table).

    python bench/bench_precision_quality.py --cards wan-tiny --record bench/records/precision_quality_cpu.json
    python bench/bench_precision_quality.py --cards wan-toy --precisions fp32 --threads 2 --judge-n 16 \
        --record bench/records/precision_quality_cpu.json          # about 3 minutes a path on 2 CPU threads

(The defaults, both cards at fp32 and bf16, include wan-toy's bf16 trajectories: CPU bf16 matmuls
made one 16-clip bf16 run take over 9 minutes here.)

For each card and instance precision, one instance per precision path (``native`` and each path
the card lists) generates the same text-to-video requests (fixed prompts and seeds, the card's
default steps and shape) on CPU, with the torch reference kernels (``Fp8Linear``'s and the fp8
attention driver's; the Triton kernels compute the same math on CUDA and are checked against these
references by their own tests, so quality is measured here without a GPU). Reported per path: the
PSNR of each final decoded video against the native path's, one sample per seed and prompt (16
held-out prompts on ``wan-toy``, one prompt at 3 seeds on ``wan-tiny``), as their mean and the 95%
lower confidence bound of the mean that the contract judges, and on cards
with the toy judge (``wan-toy``) the judge's colour and direction scores in points (percent of
prompted objects right) next to native's, over ``--judge-n`` held-out prompts. Each path's
contract (``card.precision.paths``) gives the verdict. ``--record`` merges the measurements into a
``TierParityRecord`` file (its ``precision_paths``), which a deployment names as
``compute.parity_record``: ``precision_path: auto`` reads it. Steps are not timed here (CPU runs
the reference kernels): ``auto`` picks a path only where a measurement times it faster than native.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
from pathlib import Path

import torch
from bench_toy_quality import generate_all, load_card  # bench/, beside this script
from fv_wan.toy.grammar import held_out_prompts
from fv_wan.toy.judge import judge, summarise

from fv_kernel.api import (
    DiffusionParams,
    Engine,
    InstanceOptions,
    ModelCard,
    PrecisionPathMeasurement,
    PrecisionPathSample,
    Request,
    TaskType,
    TextPart,
    TierParityRecord,
    build_instance,
)
from fv_kernel.compute.compile import load_parity_record

JUDGED = ("colour", "direction")
TINY_PROMPT = "a red fox runs through fresh snow"
#: wan-tiny (random weights, no judge): this prompt at this many seeds, the contract's fewest samples.
TINY_SAMPLES = 3


def psnr(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """PSNR (dB, frames in [0, 1]) of ``other`` against ``reference``, one MSE over every clip."""
    mse = float(sum(((r - o) ** 2).sum() for r, o in zip(reference, other)) / sum(r.numel() for r in reference))
    return float("inf") if mse == 0 else -10.0 * torch.log10(torch.tensor(mse)).item()


def run_path(card: ModelCard, options: InstanceOptions, path: str, prompts: list[str], seed: int) -> list[torch.Tensor]:
    instance = build_instance(card, options.model_copy(update={"precision_path": path}))
    engine = Engine()
    engine.add_instance(instance)
    requests = [
        Request(request_id=f"{path}-{i}", model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=p),),
                diffusion=DiffusionParams(seed=seed + i))
        for i, p in enumerate(prompts)
    ]
    videos, _ = generate_all(engine, requests)
    return videos


def judge_scores(videos: list[torch.Tensor], prompts: list[str]) -> dict[str, float]:
    summary = summarise([judge(v, p) for v, p in zip(videos, prompts)]).as_dict()
    return {name: 100.0 * float(summary[name]) for name in JUDGED}


def measure(card: ModelCard, options: InstanceOptions, precision: str, paths: list[str], args: argparse.Namespace,
            command: str) -> list[PrecisionPathMeasurement]:
    judged = card.model_id == "wan-toy"
    prompts = held_out_prompts(args.judge_n, seed=0) if judged else [TINY_PROMPT] * TINY_SAMPLES
    options = options.model_copy(update={"precision": precision, "device": "cpu"})
    native = run_path(card, options, "native", prompts, args.seed)
    reference_scores = judge_scores(native, prompts) if judged else {}
    d = card.capabilities.defaults
    source = (f"{datetime.date.today()}, {platform.machine()} CPU ({torch.get_num_threads()} threads), torch reference "
              f"kernels, {card.model_id} {'trained' if judged else 'seeded random'} weights, {len(prompts)} "
              f"{'held-out prompts' if judged else 'seeds of one prompt'}, seeds {args.seed}..{args.seed + len(prompts) - 1}: "
              f"{command}")
    out = []
    for path in paths:
        videos = run_path(card, options, path, prompts, args.seed)
        out.append(PrecisionPathMeasurement(
            path=path, model_id=card.model_id, precision=precision, steps=d.steps, frames=d.frames, height=d.height,
            width=d.width, samples=tuple(
                PrecisionPathSample(seed=args.seed + i, prompt=prompt, psnr_db=psnr([native[i]], [videos[i]]))
                for i, prompt in enumerate(prompts)),
            judge_scores=judge_scores(videos, prompts) if judged else {},
            reference_judge_scores=reference_scores, device="cpu", source=source,
        ))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cards", nargs="+", default=["wan-toy", "wan-tiny"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"))
    parser.add_argument("--paths", nargs="+", default=None, help="precision paths (default: every path the card lists)")
    parser.add_argument("--judge-n", type=int, default=16, help="held-out prompts the toy judge scores (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="diffusion seed of the first request (request i: seed + i)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    parser.add_argument("--record", default=None, help="merge the measurements into this parity record file")
    args = parser.parse_args()
    if args.judge_n < 1:
        raise SystemExit(f"--judge-n must be at least 1, got {args.judge_n}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_precision_quality.py", *sys.argv[1:]])
    measurements: list[PrecisionPathMeasurement] = []
    print("| card | precision | path | PSNR vs native, mean (95% lower bound) (dB) | colour (native) | direction (native) "
          "| contract |")
    print("|---|---|---|---|---|---|---|")
    for model in args.cards:
        card, options = load_card(model, "cpu")
        listed = list(card.precision.paths)
        paths = args.paths or listed
        unknown = [p for p in paths if p not in listed]
        if unknown:
            raise SystemExit(f"--paths: card {card.model_id} does not list {unknown}; allowed: {listed}")
        for precision in args.precisions:
            for m in measure(card, options, precision, paths, args, command):
                measurements.append(m)
                verdict = card.precision.paths[m.path].check(m, model_id=m.model_id, precision=precision,
                                                             defaults=card.capabilities.defaults)
                scores = [f"{m.judge_scores[n]:.1f} ({m.reference_judge_scores[n]:.1f})" if m.judge_scores else "-"
                          for n in JUDGED]
                stats = m.statistics()
                print(f"| {m.model_id} | {precision} | {m.path} | {stats.mean_db:.2f} ({stats.lower_bound_db:.2f}) | "
                      f"{scores[0]} | {scores[1]} | "
                      f"{'pass' if verdict.passed else 'FAIL'} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([m.model_dump(mode="json") for m in measurements], indent=2))
    if args.record:
        path = Path(args.record)
        record = load_parity_record(str(path)) if path.exists() else TierParityRecord()
        path.write_text(record.merged_paths(measurements).model_dump_json(indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
