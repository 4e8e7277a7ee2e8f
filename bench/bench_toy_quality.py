"""Toy-world prompt following: a card's videos for the held-out prompts, scored by the toy judge.

    python bench/bench_toy_quality.py                                  # wan-toy, 100 held-out prompts
    python bench/bench_toy_quality.py --model wan-tiny --n 20          # random weights: a chance-level figure
    python bench/bench_toy_quality.py --ground-truth                   # the judge on the world's own clips
    python bench/bench_toy_quality.py --cachedit --cache dbcache --thresholds 0.05 0.08 0.12
    python bench/bench_toy_quality.py --render-throughput 1024 --device cuda   # training-data rate

The prompts are ``fv_wan.toy.grammar.held_out_prompts(n, seed)`` (never seen in training);
request ``i`` uses diffusion seed ``--seed + i`` at the card's default size, frames and
steps (``--steps`` overrides the steps). All requests of a run are submitted at once to
one ``Engine`` (fv's public API), which batches their steps. Each video is judged by
``fv_wan.toy.judge`` against its prompt; reported: colour, direction, speed and shape
accuracy (per prompted object), stability and all-correct (per clip), the wall time of
the generation and the clips per second.

``--cachedit`` repeats the run under fv-cachedit's block cache at each ``--thresholds``
value (0, the uncached reference, always runs first), enabled as a deploy extension and
parameterised per request the way bench_cachedit.py does, and reports quality and the
speed-up of the generation wall time over the reference, plus the mean PSNR of each
clip against its uncached counterpart.

``--ground-truth`` skips the model: it renders the same prompts with the toy world at the
card's size and frame count and scores them (the judge's ceiling for that geometry).
``--vae-roundtrip`` scores those renders after the card's VAE encodes (posterior mean) and
decodes them: the ceiling the card's VAE leaves its DiT.

``--render-throughput B`` measures the training data rate instead: ``ToyWorld.batch`` of B
clips at the card's geometry on ``--device`` (after one warm-up batch, ``--batches`` timed),
reporting clips per second in total and for the CPU part alone (scene sampling and layout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import torch

from fv_kernel.api import (
    DeployConfig,
    DiffusionParams,
    Engine,
    ExtensionSet,
    FvError,
    InstanceOptions,
    ModelCard,
    Request,
    TaskType,
    TextPart,
    build_instance,
)
from fv_kernel.plugins import PluginHost
from fv_kernel.deploy.model_resolution import resolve_model
from fv_wan.toy.grammar import held_out_prompts
from fv_wan.toy.judge import Judgement, judge, summarise
from fv_wan.toy.world import GENERATOR_VERSION, ToyWorld, layout, render

ACCURACIES = ("colour", "direction", "speed", "shape", "stability", "all_correct")


def load_card(model: str, device: str) -> tuple[ModelCard, InstanceOptions]:
    """The card ``model`` names (an id, a card file or a checkpoint folder, as ``fv generate --model``) and its instance options."""
    host = PluginHost()
    host.start()
    try:
        choice = resolve_model(model, DeployConfig(), host, device=device)
    except FvError as exc:
        raise SystemExit(f"--model: {exc}") from None
    return choice.card, choice.options


def generate_all(engine: Engine, requests: list[Request]) -> tuple[list[torch.Tensor], float]:
    """Submit every request to the running engine at once; their videos in order and the wall time."""

    async def run() -> tuple[list[torch.Tensor], float]:
        async with engine.running():
            start = time.perf_counter()
            handles = [engine.submit(request) for request in requests]
            results = await asyncio.gather(*(handle.result() for handle in handles))
            wall = time.perf_counter() - start
        videos = []
        for result in results:
            result.raise_for_status()
            artifact = result.artifact("video")
            assert artifact is not None, f"request {result.request_id} returned no video"
            videos.append(artifact.frames.detach().to("cpu", torch.float32).clamp(0.0, 1.0))
        return videos, wall

    return asyncio.run(run())


def judged(videos: list[torch.Tensor], prompts: list[str]) -> tuple[dict[str, Any], list[Judgement]]:
    judgements = [judge(video, prompt) for video, prompt in zip(videos, prompts)]
    return summarise(judgements).as_dict(), judgements


def clip_rows(judgements: list[Judgement]) -> list[dict[str, Any]]:
    return [
        {
            "prompt": j.prompt,
            "correct": j.correct,
            "stable": j.stable,
            "extra_colours": list(j.extra_colours),
            "objects": [
                {"colour": o.colour, "direction": o.direction, "speed": o.speed, "shape": o.shape,
                 "detected_shape": o.detected_shape, "displacement": list(o.displacement)}
                for o in j.objects
            ],
        }
        for j in judgements
    ]


def psnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    mse = float(((reference - other) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * torch.log10(torch.tensor(1.0 / mse)).item()


@torch.no_grad()
def vae_roundtrip(card: ModelCard, options: InstanceOptions, videos: list[torch.Tensor], device: str) -> list[torch.Tensor]:
    """Clips (F, 3, H, W) in [0, 1] encoded to the posterior mean by the card's VAE and decoded back."""
    vae = build_instance(card, options).component("vae").to(device).eval()
    out = []
    for video in videos:
        clip = video.to(device).permute(1, 0, 2, 3).unsqueeze(0).mul(2).sub(1)  # (1, 3, F, H, W) in [-1, 1]
        decoded = vae.decode(vae.encode(clip)[0]).float()
        out.append(decoded[0].permute(1, 0, 2, 3).add(1).div(2).clamp(0.0, 1.0).cpu())
    return out


def render_throughput(args: argparse.Namespace, frames: int, height: int, width: int, meta: dict[str, Any]) -> int:
    """Clips per second of ``ToyWorld.batch`` (all of it, and its CPU part alone) at one geometry."""
    size = args.render_throughput
    if size < 1 or args.batches < 1:
        raise SystemExit(f"--render-throughput and --batches must be at least 1, got {size} and {args.batches}")
    device = torch.device(args.device)
    world = ToyWorld(frames=frames, height=height, width=width, seed=0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    world.batch(0, size, device=device)  # warm-up: allocator, kernels
    sync()
    start = time.perf_counter()
    for index in range(1, args.batches + 1):
        world.batch(index, size, device=device)
    sync()
    total = time.perf_counter() - start
    start = time.perf_counter()
    for index in range(1, args.batches + 1):
        scenes, seeds = world.scenes(index, size)
        for scene, seed in zip(scenes, seeds):
            layout(scene, height=height, width=width, seed=seed)
    cpu = time.perf_counter() - start
    clips = size * args.batches
    row = {"batch": size, "batches": args.batches, "wall_s": total, "clips_per_s": clips / total,
           "cpu_part_s": cpu, "cpu_part_clips_per_s": clips / cpu}
    print(f"ToyWorld.batch({size}) at {frames}x{height}x{width} (FxHxW) on {args.device}, "
          f"{torch.get_num_threads()} threads, {args.batches} batches\n")
    print("| batch | clips/s | CPU part (sampling + layout) clips/s |\n|---|---|---|")
    print(f"| {size} | {row['clips_per_s']:.0f} | {row['cpu_part_clips_per_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": {**meta, "mode": "render_throughput"}, "rows": [row]}, fh, indent=2)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wan-toy",
                        help="a text-to-video card id, card file or checkpoint folder, as fv generate --model (default: wan-toy)")
    parser.add_argument("--n", type=int, default=100, help="held-out prompts to generate (default 100)")
    parser.add_argument("--prompt-seed", type=int, default=0, help="which held-out prompt set (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="diffusion seed of the first request; request i uses seed + i")
    parser.add_argument("--steps", type=int, default=None, help="denoise steps (default: the card's)")
    parser.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale (default: the card's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU (default: torch's)")
    parser.add_argument("--ground-truth", action="store_true", help="score the toy world's own renders instead of the card")
    parser.add_argument("--vae-roundtrip", action="store_true",
                        help="score the toy world's renders after the card's VAE encodes and decodes them")
    parser.add_argument("--cachedit", action="store_true", help="repeat under fv-cachedit thresholds")
    parser.add_argument("--cache", default="dbcache", choices=("dbcache", "fbcache", "taylorseer"))
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.08, 0.12, 0.2])
    parser.add_argument("--warmup", type=int, default=None, help="cache max_warmup_steps (default: a quarter of the steps)")
    parser.add_argument("--render-throughput", type=int, default=None, metavar="B",
                        help="measure ToyWorld.batch clips/s at batch size B instead of judging a card")
    parser.add_argument("--batches", type=int, default=5, help="timed batches for --render-throughput (default 5)")
    parser.add_argument("--json", default=None, help="also write the figures (and per-clip verdicts) to this JSON file")
    args = parser.parse_args()
    if args.n < 1:
        raise SystemExit(f"--n must be at least 1, got {args.n}")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"skipped: --device {args.device} asked for CUDA, which this machine does not have")
        return 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    card, options = load_card(args.model, args.device)
    if TaskType.TEXT_TO_VIDEO not in card.capabilities.tasks or card.capabilities.defaults is None:
        raise SystemExit(f"--model: {card.model_id} has no text-to-video defaults")
    defaults = card.capabilities.defaults
    prompts = held_out_prompts(args.n, seed=args.prompt_seed)
    steps = args.steps or defaults.steps
    geometry = f"{defaults.frames}x{defaults.height}x{defaults.width}"
    meta: dict[str, Any] = {
        "card": card.model_id, "prompts": args.n, "prompt_seed": args.prompt_seed, "seed": args.seed, "steps": steps, "guidance": args.guidance,
        "geometry_fhw": geometry, "device": args.device, "threads": torch.get_num_threads(),
        "generator_version": GENERATOR_VERSION, "ground_truth": args.ground_truth, "vae_roundtrip": args.vae_roundtrip,
    }
    rows: list[dict[str, Any]] = []

    if args.render_throughput is not None:
        return render_throughput(args, defaults.frames, defaults.height, defaults.width, meta)
    if args.ground_truth or args.vae_roundtrip:
        from fv_wan.toy.grammar import parse_prompt

        start = time.perf_counter()
        videos = [
            render(parse_prompt(p), frames=defaults.frames, height=defaults.height, width=defaults.width, seed=args.seed + i)
            for i, p in enumerate(prompts)
        ]
        if args.vae_roundtrip:
            videos = vae_roundtrip(card, options, videos, args.device)
        wall = time.perf_counter() - start
        scores, judgements = judged(videos, prompts)
        rows.append({"threshold": None, "wall_s": wall, "clips_per_s": len(prompts) / wall, **scores,
                     "verdicts": clip_rows(judgements)})
    else:
        thresholds = [0.0] + (list(args.thresholds) if args.cachedit else [])
        extensions = None
        if args.cachedit:
            from fv_cachedit import DBCache, FBCache, TaylorSeer

            blocks = int(card.components["transformer"].config["num_layers"])
            config: dict[str, Any] = {"bn_compute_blocks": 0,
                                      "max_warmup_steps": args.warmup if args.warmup is not None else max(1, steps // 4)}
            if args.cache != "fbcache":
                config["fn_compute_blocks"] = 8 if blocks > 8 else 1
            classes = {"dbcache": DBCache, "fbcache": FBCache, "taylorseer": TaylorSeer}
            extensions = ExtensionSet.build({args.cache: {"config": config}}, {args.cache: classes[args.cache]})
            meta.update({"cache": args.cache, "cache_config": config, "blocks": blocks})
        instance = build_instance(card, options)
        engine = Engine(extensions=extensions)
        engine.add_instance(instance)

        def requests(threshold: float, tag: str) -> list[Request]:
            params = {args.cache: {"residual_diff_threshold": threshold}} if threshold > 0 else {}
            return [
                Request(
                    request_id=f"toy-{tag}-{i}", model=card.model_id, task=TaskType.TEXT_TO_VIDEO,
                    inputs=(TextPart(text=prompt),),
                    diffusion=DiffusionParams(seed=args.seed + i, steps=steps, guidance=args.guidance),
                    plugin_params=params,
                )
                for i, prompt in enumerate(prompts)
            ]

        # Weights resident, kernels and allocator warm before anything is timed. Concurrent first
        # requests load each component once: builds are serialised process-wide (ModelInstance).
        generate_all(engine, requests(0.0, "warmup")[:3])
        reference: list[torch.Tensor] = []
        for threshold in thresholds:
            videos, wall = generate_all(engine, requests(threshold, f"t{threshold}"))
            if threshold == 0.0:
                reference = videos
            scores, judgements = judged(videos, prompts)
            row = {"threshold": threshold, "wall_s": wall, "clips_per_s": len(prompts) / wall, **scores,
                   "speedup": rows[0]["wall_s"] / wall if rows else 1.0,
                   "psnr_db_vs_uncached": sum(psnr(r, v) for r, v in zip(reference, videos)) / len(videos)
                   if threshold > 0 else None,
                   "verdicts": clip_rows(judgements)}
            rows.append(row)

    source = (f"toy world through {card.model_id}'s VAE" if args.vae_roundtrip
              else "toy world ground truth" if args.ground_truth else card.model_id)
    print(f"{source}: {args.n} held-out prompts (set {args.prompt_seed}), {geometry} (FxHxW), "
          f"{'' if args.ground_truth or args.vae_roundtrip else f'{steps} steps, '}{args.device}, {torch.get_num_threads()} threads\n")
    header = "| threshold | wall s | clips/s | speed-up | " + " | ".join(ACCURACIES) + " |"
    print(header)
    print("|" + "---|" * (4 + len(ACCURACIES)))
    for row in rows:
        threshold = "-" if row["threshold"] is None else f"{row['threshold']:.2f}"
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
        print(f"| {threshold} | {row['wall_s']:.1f} | {row['clips_per_s']:.2f} | {speedup} | "
              + " | ".join(f"{100 * row[name]:.0f}%" for name in ACCURACIES) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
