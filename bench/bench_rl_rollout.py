"""fv-rl: rollout throughput of a K-sample group against one-at-a-time, and the time of one weight sync.

    python bench/bench_rl_rollout.py                                  # the 1.3B card, random weights, on CUDA
    python bench/bench_rl_rollout.py --card wan-tiny --device cpu --height 32 --width 32 --frames 5 --steps 3   # smoke

Both sides run the same K requests (one prompt, K seeds, behaviour capture "final", CFG off)
through one Engine on the card's loops: "grouped" submits them as fv-rl's rollout group (one
text encode, the K denoise steps batched by the scheduler); "one at a time" awaits each
request before submitting the next. A warm-up group runs first and is not timed. Then one
``Engine.sync_weights`` of the transformer (freeze, drain, load_state_dict, version bump,
cache clear, resume) is timed with the engine idle.

Real-size cards are built on seeded random weights (no download) with a one-layer random text
encoder of the transformer's text width (the benchmark does not time UMT5-XXL). Without CUDA,
``--device cuda`` prints that nothing was measured and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import time
from typing import Any

import torch

from fv_kernel.api import DiffusionParams, Engine, InstanceOptions, OutputSpec, Request, TaskType, TextPart, build_instance
from fv_kernel.plugins import PluginHost
from fv_rl.online import load_policy_into
from fv_rl.rollout import RolloutSettings, rollout_group
from random_weights import random_weight_card  # bench/, beside this script


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _one_at_a_time(engine: Engine, model_id: str, seeds: list[int], s: RolloutSettings) -> None:
    for seed in seeds:
        request = Request(model=model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a red fox"),), priority=s.priority,
                          diffusion=DiffusionParams(steps=s.steps, guidance=s.guidance, height=s.height, width=s.width,
                                                    frames=s.frames, seed=seed),
                          output=OutputSpec(capture_behavior=s.capture))
        result = await engine.generate_async(request)
        assert result.status == "completed", result.error


async def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    host = PluginHost()
    host.start()
    from fv_kernel.api import CardCatalog

    card = random_weight_card(CardCatalog(host).get(args.card))
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    instance = build_instance(card, InstanceOptions(device=str(device), precision=precision, registry=host.registry()))
    engine = Engine()
    engine.add_instance(instance)
    settings = RolloutSettings(steps=args.steps, guidance=1.0, height=args.height, width=args.width, frames=args.frames, capture="final")
    seeds = list(range(args.k))
    out: dict[str, Any] = {"card": args.card, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "precision": precision, "k": args.k, "steps": args.steps,
                           "shape": f"{args.height}x{args.width}x{args.frames}", "repeats": args.repeats}
    async with engine.running():
        await rollout_group(engine, card.model_id, "a red fox", seeds, settings)  # warm-up: loads, allocator
        for name, run in (("grouped_s", lambda: rollout_group(engine, card.model_id, "a red fox", seeds, settings)),
                          ("one_at_a_time_s", lambda: _one_at_a_time(engine, card.model_id, seeds, settings))):
            times = []
            for _ in range(args.repeats):
                _sync(device)
                start = time.perf_counter()
                await run()
                _sync(device)
                times.append(time.perf_counter() - start)
            out[name] = min(times)
        new_weights = copy.deepcopy(instance.component("transformer"))
        _sync(device)
        start = time.perf_counter()
        await engine.sync_weights(card.model_id, load_policy_into(new_weights))
        _sync(device)
        out["weight_sync_s"] = time.perf_counter() - start
    out["grouped_samples_per_s"] = args.k / out["grouped_s"]
    out["one_at_a_time_samples_per_s"] = args.k / out["one_at_a_time_s"]
    out["speedup"] = out["one_at_a_time_s"] / out["grouped_s"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="wan2.1-t2v-1.3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--width", type=int, default=416)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: nothing measured (this benchmark's figures are for a GPU)")
        return 0
    out = asyncio.run(measure(args, device))
    print(f"{out['card']} {out['shape']}, {out['steps']} steps, K={out['k']}, {out['precision']} on {out['device']} (random weights)")
    print(f"  grouped        {out['grouped_s']:.2f} s  ({out['grouped_samples_per_s']:.2f} samples/s)")
    print(f"  one at a time  {out['one_at_a_time_s']:.2f} s  ({out['one_at_a_time_samples_per_s']:.2f} samples/s)")
    print(f"  speed-up       {out['speedup']:.2f}x;  one weight sync {out['weight_sync_s'] * 1000:.0f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
