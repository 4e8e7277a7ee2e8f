"""Cosmos 3 benchmarks on CPU with ``cosmos3-tiny`` (plus weight arithmetic for the real sizes).

    python bench/bench_cosmos3.py out.json [--repeats 20]

1. Text K/V reuse: one denoise step (cond + uncond generator passes) with the prompt
   K/V cached once per request vs recomputed every step (what diffusers does).
2. Batched decode: ``ar_token`` throughput of 8 concurrent decode requests through the
   Engine, batched (``batching="throughput"``) vs serial (one request at a time).
3. Memory: one instance serving text + video vs two separate instances (a reasoner-only
   engine + a generator engine that must hold the reasoner tower too for the text K/V):
   resident weight bytes (tiny measured; Nano/Super counted on the meta device) and the
   peak RSS of a process doing one text decode and one T2V request.

Prints a markdown table and writes the numbers as JSON to the given path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT
from fv_cosmos3.models.state_dict import is_reasoner_key
from fv_cosmos3.models.tokenizer import PromptSpec, build_generation_prompt
from fv_kernel.api import (
    ARParams, DiffusionParams, Engine, Request, SchedulerConfig, TaskType, TextPart, build_instance,
)


def _median_ms(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def bench_text_kv_reuse(repeats: int) -> dict[str, float]:
    instance = build_instance(cosmos3_card("cosmos3-tiny"))
    mot: Cosmos3MoT = instance.component("transformer")
    tok = instance.component("tokenizer")
    spec = PromptSpec(num_frames=5, height=32, width=64, fps=24.0)
    cond = torch.tensor([build_generation_prompt("a red fox runs through deep snow at dawn", tok, spec)])
    uncond = torch.tensor([build_generation_prompt("", tok, spec, negative=True)])
    video = torch.randn(1, 4, 2, 2, 4, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        kv = {b: mot.text_kv_for_generation(ids) for b, ids in (("cond", cond), ("uncond", uncond))}

        def cached() -> None:
            for branch in ("cond", "uncond"):
                mot.generate_forward(kv[branch], video, 500.0)

        def recomputed() -> None:
            for ids in (cond, uncond):
                mot.generate_forward_recompute(ids, video, 500.0)

        c, r = _median_ms(cached, repeats), _median_ms(recomputed, repeats)
    return {"text_tokens_cond": cond.shape[1], "text_tokens_uncond": uncond.shape[1], "video_tokens": 4,
            "step_ms_cached": c, "step_ms_recomputed": r, "speedup": r / c}


def _decode_requests(prefix: str, n: int, tokens: int) -> list[Request]:
    prompts = ["a fox", "a boat drifting on a calm lake", "snow", "city lights at night in the rain", "a dog",
               "waves", "a bird over a field of wheat", "a slow train"]
    return [Request(request_id=f"{prefix}{i}", model="cosmos3-tiny", task=TaskType.TEXT_GENERATION,
                    inputs=(TextPart(text=prompts[i % len(prompts)]),),
                    ar=ARParams(max_tokens=tokens, temperature=0.8, top_k=20, seed=i, stop_token_ids=()))
            for i in range(n)]


def _run_engine(config: SchedulerConfig, requests: list[Request]) -> tuple[float, int, dict[int, int]]:
    engine = Engine(config)
    engine.add_instance(build_instance(cosmos3_card("cosmos3-tiny")))

    async def go() -> list[Any]:
        async with engine.running():
            start = time.perf_counter()
            handles = [engine.submit(r) for r in requests]
            results = await asyncio.gather(*(h.result() for h in handles))
            return [time.perf_counter() - start, results]

    seconds, results = asyncio.run(go())
    tokens = sum(len(r.artifacts[0].token_ids) for r in results)
    return seconds, tokens, dict(engine.metrics.batches_by_size)


def bench_batched_decode(n: int = 8, tokens: int = 32) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": n, "max_tokens": tokens}
    for name, config in (
        ("batched", SchedulerConfig(batching="throughput")),
        ("interleaved_exact", SchedulerConfig(batching="exact")),
        ("serial", SchedulerConfig(scheduling="request")),
    ):
        _run_engine(config, _decode_requests(f"warm-{name}-", 2, 4))
        seconds, produced, batches = _run_engine(config, _decode_requests(f"{name}-", n, tokens))
        out[name] = {"seconds": seconds, "tokens": produced, "tokens_per_s": produced / seconds,
                     "largest_batch": max(batches)}
    out["speedup_batched_vs_serial"] = out["batched"]["tokens_per_s"] / out["serial"]["tokens_per_s"]
    return out


def _weight_bytes(config: Cosmos3Config, dtype: torch.dtype) -> dict[str, int]:
    with torch.device("meta"):
        model = Cosmos3MoT(config)
    size = torch.empty((), dtype=dtype).element_size()
    total = sum(p.numel() for p in model.state_dict().values()) * size
    reasoner = sum(p.numel() for k, p in model.state_dict().items() if is_reasoner_key(k)) * size
    # Two engines: a text server with the reasoner (+ lm_head), and a diffusion server with the whole MoT,
    # because the generator's queries need the reasoner tower's K/V of the prompt.
    return {"one_instance": total, "two_instances": reasoner + total, "reasoner_only": reasoner}


_RSS_CHILD = r"""
import resource, sys, torch
from fv_cosmos3.cards import cosmos3_card
from fv_kernel.api import *
from fv_kernel.runtime.local import run_local
two = sys.argv[1] == "two"
text_inst = build_instance(cosmos3_card("cosmos3-tiny"))
video_inst = build_instance(cosmos3_card("cosmos3-tiny")) if two else text_inst
run_local(Request(model="cosmos3-tiny", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="a fox"),),
                  ar=ARParams(max_tokens=8)), text_inst)
run_local(Request(model="cosmos3-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),)), video_inst)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def bench_memory() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, factory in (("tiny_fp32", lambda: (Cosmos3Config.tiny(), torch.float32)),
                          ("nano_bf16", lambda: (Cosmos3Config.nano(), torch.bfloat16)),
                          ("super_bf16", lambda: (Cosmos3Config.super_(), torch.bfloat16))):
        config, dtype = factory()
        out[name] = _weight_bytes(config, dtype)
    for mode in ("one", "two"):
        rss = subprocess.run([sys.executable, "-c", _RSS_CHILD, mode], capture_output=True, text=True, check=True)
        out[f"tiny_peak_rss_kib_{mode}"] = int(rss.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="path of the JSON file to write")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "text_kv_reuse": bench_text_kv_reuse(args.repeats),
        "batched_decode": bench_batched_decode(),
        "memory": bench_memory(),
    }
    kv, dec, mem = results["text_kv_reuse"], results["batched_decode"], results["memory"]
    gib = 2**30
    rows = [
        ("denoise step, text K/V cached once (ms)", f"{kv['step_ms_cached']:.2f}"),
        ("denoise step, text K/V recomputed each step (ms)", f"{kv['step_ms_recomputed']:.2f}"),
        ("  speedup", f"{kv['speedup']:.2f}x"),
        ("ar_token, 8 requests batched (tok/s)", f"{dec['batched']['tokens_per_s']:.1f} (largest batch {dec['batched']['largest_batch']})"),
        ("ar_token, 8 requests interleaved, exact mode (tok/s)", f"{dec['interleaved_exact']['tokens_per_s']:.1f}"),
        ("ar_token, 8 requests serial (tok/s)", f"{dec['serial']['tokens_per_s']:.1f}"),
        ("  speedup batched vs serial", f"{dec['speedup_batched_vs_serial']:.2f}x"),
        ("tiny weights: one instance / two instances (KiB)",
         f"{mem['tiny_fp32']['one_instance'] / 1024:.0f} / {mem['tiny_fp32']['two_instances'] / 1024:.0f}"),
        ("tiny process peak RSS: one / two instances (MiB)",
         f"{mem['tiny_peak_rss_kib_one'] / 1024:.0f} / {mem['tiny_peak_rss_kib_two'] / 1024:.0f}"),
        ("Nano bf16 weights: one / two instances (GiB)",
         f"{mem['nano_bf16']['one_instance'] / gib:.1f} / {mem['nano_bf16']['two_instances'] / gib:.1f}"),
        ("Super bf16 weights: one / two instances (GiB)",
         f"{mem['super_bf16']['one_instance'] / gib:.1f} / {mem['super_bf16']['two_instances'] / gib:.1f}"),
    ]
    print("| measurement (CPU, cosmos3-tiny, 1 thread) | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    with open(args.output, "w") as handle:
        json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
