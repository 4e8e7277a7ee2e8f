"""How far throughput batching moves a card's results from the same requests run alone.

What a card's ``parity.batched_vs_alone`` declares, measured: ``--requests`` requests of one
shape (different prompts and seeds) run (a) each alone on its own engine, (b) all at once under
``batching: throughput``, and (c) staggered, each submitted once the one before it has run
``--offset`` steps of its denoise (or decode) loop, so fused forwards hold rows at different
timesteps. The card is measured under a copy of itself that declares an unbounded tolerance at
the instance's precision, so the engine fuses what it would fuse with a real declaration.
Prints the largest absolute difference of any artifact per arrival pattern, the fused batches
and those whose rows were at different steps, and writes them as JSON.

    python bench/bench_batched_vs_alone.py out.json --card wan-tiny
    python bench/bench_batched_vs_alone.py out.json --card wan2.1-t2v-1.3b --device cuda --frames 1 --height 480 --width 832
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from datetime import date
from pathlib import Path
from typing import Any

import torch

from fv_kernel.api import (
    BatchedVsAlone,
    DiffusionParams,
    Engine,
    InstanceOptions,
    ModelCard,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    build_instance,
)
from fv_kernel.testing import StepRecorder

PROMPTS = ("a red fox runs through snow", "a lighthouse at dusk, waves", "a paper boat on a puddle",
           "a cat watches rain on a window", "a field of sunflowers, wind", "a train crosses a bridge at night",
           "a hummingbird at a feeder", "a city street in the fog")


def load_card(card_id: str, device: torch.device) -> ModelCard:
    from fv_kernel.testing.toy import toy_card, toy_cards

    if card_id in {c.model_id for c in toy_cards()}:
        return toy_card(card_id)
    from fv_wan.cards import wan_cards

    if card_id in {c.model_id for c in wan_cards()}:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from random_weights import wan_card_for_device  # bench/random_weights.py: real-size cards on random weights

        card = wan_card_for_device(card_id, device)
        if card is None:
            raise SystemExit(2)
        return card
    from fv_kernel.api import CardCatalog, PluginHost

    return CardCatalog(PluginHost()).get(card_id)


def measuring(card: ModelCard, precision: str) -> ModelCard:
    """``card`` declaring an unbounded batched-vs-alone tolerance at ``precision``: the engine fuses
    its steps there, and this script measures what that does (never a card to deploy)."""
    entry = BatchedVsAlone(precision=precision, max_abs=math.inf, justification="measurement only")  # type: ignore[arg-type]
    others = tuple(e for e in card.parity.batched_vs_alone if e.precision != precision)
    return card.model_copy(update={"parity": card.parity.model_copy(update={"batched_vs_alone": (*others, entry)})})


def requests_for(card: ModelCard, args: argparse.Namespace) -> list[Request]:
    task = TaskType.TEXT_TO_IMAGE if args.frames == 1 and TaskType.TEXT_TO_IMAGE in card.capabilities.tasks else TaskType.TEXT_TO_VIDEO
    diffusion = {k: v for k, v in dict(height=args.height, width=args.width, steps=args.steps).items() if v is not None}
    if task is TaskType.TEXT_TO_VIDEO and args.frames is not None:
        diffusion["frames"] = args.frames
    return [
        Request(request_id=f"r{i}", model=card.model_id, task=task, inputs=(TextPart(text=PROMPTS[i % len(PROMPTS)]),),
                diffusion=DiffusionParams(seed=i, **diffusion))
        for i in range(args.requests)
    ]


def max_abs(a: list[Any], b: list[Any]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        for name in ("frames", "samples", "latents", "tensor"):
            ta, tb = getattr(x, name, None), getattr(y, name, None)
            if isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor):
                worst = max(worst, float((ta.double() - tb.double()).abs().max()))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--card", default="wan-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default=None, help="default: the card's")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--offset", type=int, default=1, help="steps the previous request has run when the next arrives")
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    from fv_kernel.testing.batching import run_staggered
    from fv_kernel.runtime.engine import run_concurrently, run_serially

    device = torch.device(args.device)
    card = load_card(args.card, device)
    precision = args.precision or card.precision.default
    card = measuring(card, precision)
    assumed = card.recipe.assumes_attention
    options = InstanceOptions(device=args.device, precision=precision,
                              attention_backend=assumed.kind if assumed is not None else "sdpa")
    instance = build_instance(card, options)
    requests = requests_for(card, args)
    config = SchedulerConfig(batching="throughput", device_thread=False)
    alone = [run_serially(_engine(config, instance), [r])[0] for r in requests]
    for result in alone:
        result.raise_for_status()
    stagger_loop = next(lid for lid, spec in card.loops.items() if spec.kind == "diffusion_denoise")
    rows = []
    for pattern in ("concurrent", "staggered"):
        engine = _engine(config, instance)
        recorder = StepRecorder()
        engine.observers.append(recorder)
        if pattern == "concurrent":
            got = run_concurrently(engine, requests)
        else:
            got = run_staggered(engine, requests, loop_id=stagger_loop, offset=args.offset)
        for result in got:
            result.raise_for_status()
        fused = [r for r in recorder.records if sum(r.fused) > 1]
        mixed = [r for r in fused if len({s for s, f in zip(r.steps, r.fused) if f}) > 1]
        worst = max(max_abs(a.artifacts, b.artifacts) for a, b in zip(alone, got))
        rows.append({"pattern": pattern, "max_abs": worst, "fused_batches": len(fused), "mixed_step_fused_batches": len(mixed)})
        print(f"{args.card} {precision} {pattern:>10}: max |batched - alone| = {worst:.3g}; fused batches "
              f"{len(fused)}, at mixed steps {len(mixed)}", file=sys.stderr)
    result = {"card": args.card, "precision": precision, "device": str(device), "requests": args.requests,
              "shape": {k: getattr(args, k) for k in ("frames", "height", "width", "steps")}, "rows": rows,
              "date": date.today().isoformat(), "torch": torch.__version__, "machine": platform.machine(),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
    args.output.write_text(json.dumps(result, indent=2))
    return 0


def _engine(config: SchedulerConfig, instance: Any) -> Engine:
    engine = Engine(config)
    engine.add_instance(instance)
    return engine


if __name__ == "__main__":
    raise SystemExit(main())
