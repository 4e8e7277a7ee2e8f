"""fv-rl: one adapter-only weight sync (options.lora) against one full transformer sync, in the same run.

    python bench/bench_rl_lora_sync.py                                    # the 1.3B card, random weights, on CUDA
    python bench/bench_rl_lora_sync.py --device cpu --precision bf16      # the same card on the CPU
    python bench/bench_rl_lora_sync.py --card wan-tiny --device cpu       # smoke

The method of ``bench_rl_rollout.py``'s sync figure: an Engine serving the card's instance
(seeded random weights, a one-layer random text encoder), idle, and one ``Engine.sync_weights``
timed from the call to its return (freeze, drain, load, version bump, cache clear, resume),
the device synchronised on both sides. "full": ``load_policy_into`` a copy of the transformer
(clone of the state dict, then ``load_state_dict``), as the RL loop syncs without LoRA. "lora":
``fv_rl.lora.sync_adapter`` with a rank-``--rank`` adapter on every attention and FFN linear of
the blocks (a copy of the adapter into the rollout instance's slot; the first sync also
installs the slot's hooks, timed separately). The two alternate, ``--repeats`` times each (so
both see the same load on a shared machine); the best, the median and every time are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import time
from typing import Any

import torch

from fv_kernel.api import Engine, InstanceOptions, build_instance
from fv_kernel.plugins import PluginHost
from fv_rl.lora import DEFAULT_TARGETS, LoraWeights, sync_adapter, target_paths
from fv_rl.online import load_policy_into
from random_weights import random_weight_card  # bench/, beside this script


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    host = PluginHost()
    host.start()
    from fv_kernel.api import CardCatalog

    card = random_weight_card(CardCatalog(host).get(args.card))
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    instance = build_instance(card, InstanceOptions(device=str(device), precision=precision, registry=host.registry()))
    transformer = instance.component("transformer")
    paths = target_paths(transformer, DEFAULT_TARGETS)
    lora = LoraWeights(transformer, paths, args.rank, float(args.rank), torch.Generator().manual_seed(0))
    with torch.no_grad():
        for up in lora.up:
            up.normal_(std=0.01)  # a trained-looking B (zero is a legal but unusual payload)
    adapters = [lora.adapter("bench", f"bench.{i}", detach=True) for i in range(args.repeats + 1)]
    new_weights = copy.deepcopy(transformer)
    engine = Engine()
    engine.add_instance(instance)
    out: dict[str, Any] = {
        "card": args.card, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": precision, "rank": args.rank, "targets": len(paths), "repeats": args.repeats,
        "transformer_bytes": sum(t.numel() * t.element_size() for t in transformer.state_dict().values()),
        "adapter_bytes": adapters[0].nbytes,
    }

    async def timed(call: Any) -> float:
        _sync(device)
        start = time.perf_counter()
        await call()
        _sync(device)
        return time.perf_counter() - start

    async with engine.running():
        slot: Any = None

        async def lora_sync(adapter: Any) -> None:
            nonlocal slot
            slot = await sync_adapter(engine, card.model_id, slot, adapter)

        first = await timed(lambda: lora_sync(adapters[0]))
        full, steady = [], []
        for adapter in adapters[1:]:  # alternated, so both see the same load on a shared machine
            full.append(await timed(lambda: engine.sync_weights(card.model_id, load_policy_into(new_weights))))
            steady.append(await timed(lambda a=adapter: lora_sync(a)))
    out.update(full_sync_s=full, lora_first_sync_s=first, lora_sync_s=steady, full_best_s=min(full), lora_best_s=min(steady),
               full_median_s=statistics.median(full), lora_median_s=statistics.median(steady))
    out["ratio_full_over_lora"] = out["full_best_s"] / out["lora_best_s"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="wan2.1-t2v-1.3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: nothing measured (run with --device cpu for the CPU figures)")
        return 0
    out = asyncio.run(measure(args, device))
    print(f"{out['card']} {out['precision']} on {out['device']} (random weights): transformer {out['transformer_bytes'] / 2**20:.0f} MiB, "
          f"rank-{out['rank']} adapter on {out['targets']} linears {out['adapter_bytes'] / 2**20:.1f} MiB")
    print(f"  full sync     best {out['full_best_s'] * 1000:.1f} ms, median {out['full_median_s'] * 1000:.1f} "
          f"({', '.join(f'{t * 1000:.1f}' for t in out['full_sync_s'])})")
    print(f"  adapter sync  best {out['lora_best_s'] * 1000:.1f} ms, median {out['lora_median_s'] * 1000:.1f} "
          f"({', '.join(f'{t * 1000:.1f}' for t in out['lora_sync_s'])}); "
          f"first, installing the hooks, {out['lora_first_sync_s'] * 1000:.1f} ms")
    print(f"  full / adapter: {out['ratio_full_over_lora']:.0f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
