"""Per-row LoRA in one batched DiT forward, against no LoRA, one request at a time, one adapter per batch,
and a merged LoRA (issue 33; docs/benchmarks.md, docs/adapters.md).

fv's Wan2.1-1.3B transformer (preset ``wan21_t2v_1_3b``) in bf16 on seeded random weights, with
rank-32 LoRAs (random, α = rank) on every attention and FFN linear of every block. Each case
times one denoise forward (CUDA events, median of ``--iters``):

(a) 8 concurrent single-frame 480x832 requests, each with its own LoRA:
    ``base``: the 8 rows in one forward, no LoRA; ``per_row``: the 8 rows in one forward, each
    row its LoRA (the routing built for every forward, as the Engine does per step);
    ``per_row_kept``: the same with the kernel's stacks kept across forwards; ``one_at_a_time``:
    8 forwards of one row, each with its LoRA per row; ``adapter_per_batch``: the anchors'
    approach (vLLM-Omni: one adapter per batch), here 8 batches of 1, each merging its LoRA
    into the weights, running, and restoring them.
(b) 4 concurrent 480x832x33 requests with different LoRAs: ``base`` vs ``per_row``.
(c) one 480x832x33 request: its LoRA merged vs the base step (and the merge + restore time).

and diffusers' ``WanTransformer3DModel`` (same weights, bf16) on (a)'s base batch as the
reference ratio. Every per-row case is also checked against its rows run alone (max abs
difference), so a fast wrong answer cannot pass. Writes ``results.json`` and ``table.md`` to
the output directory. Without CUDA it writes why and exits 0; ``--smoke`` runs every case at
tiny sizes on CPU in fp32 (the smoke test does).

    python bench/bench_lora.py out/lora               # on the H200
    python bench/bench_lora.py /tmp/lora-smoke --smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from timing import timed_calls_ms  # bench/, beside this script
from torch import nn

from fv_kernel.compute.lora import (
    AdapterWeights,
    LowRankUpdate,
    RowAdapters,
    TritonRowKernel,
    merge_adapters,
    rows_adapted,
    select_row_kernel,
)
from fv_wan.models.transformer import WanTransformer, WanTransformerConfig, cast_for_inference

#: The linears a rank-r LoRA targets in every block (the issue: "every attention and FFN linear").
TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    config: WanTransformerConfig
    height: int
    width: int
    frames: int  # (b) and (c)
    text: int
    rank: int
    requests_a: int
    requests_b: int


def sizes(smoke: bool, rank: int) -> Sizes:
    if smoke:
        return Sizes(WanTransformerConfig.tiny(), 64, 64, 5, 10, min(rank, 4), 3, 2)
    return Sizes(WanTransformerConfig.wan21_t2v_1_3b(), 480, 832, 33, 512, rank, 8, 4)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Timer:
    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def ms(self, fn: Callable[[], Any]) -> dict[str, float]:
        """Median (and spread) of ``fn`` in ms: CUDA events on the GPU, wall time on the CPU."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        times = timed_calls_ms(fn, self.device, self.iters)
        return {"ms": round(statistics.median(times), 3), "ms_min": round(min(times), 3), "ms_max": round(max(times), 3)}


def randomise_(module: nn.Module, seed: int) -> None:
    """Every parameter redrawn on its own device: N(0, 1/fan_in) for matrices, small N for vectors."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            std = p[0].numel() ** -0.5 if p.dim() > 1 else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)


def build_model(s: Sizes, device: torch.device, dtype: torch.dtype) -> WanTransformer:
    with torch.device(device):
        model = WanTransformer(s.config)
    randomise_(model, 0)
    model.rope.build_tables(device)
    return cast_for_inference(model, dtype).eval().requires_grad_(False)  # type: ignore[return-value]


def random_lora(model: nn.Module, name: str, rank: int, seed: int, dtype: torch.dtype) -> AdapterWeights:
    """A rank-``rank`` LoRA on every targeted linear; B is not zero (a trained LoRA's is not)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    updates = {}
    for block in range(len(model.blocks)):  # type: ignore[arg-type]
        for target in TARGETS:
            path = f"blocks.{block}.{target}"
            linear = model.get_submodule(path)
            assert isinstance(linear, nn.Linear)
            down = torch.randn(rank, linear.in_features, generator=gen, device=device) * linear.in_features**-0.5
            up = torch.randn(linear.out_features, rank, generator=gen, device=device) * (0.1 / rank**0.5)
            updates[path] = LowRankUpdate(down.to(dtype), up.to(dtype), alpha=float(rank))
    return AdapterWeights(name, "transformer", updates)


def inputs(s: Sizes, batch: int, frames: int, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(seed)
    latent_frames = (frames - 1) // 4 + 1
    x = torch.randn(batch, s.config.in_channels, latent_frames, s.height // 8, s.width // 8, generator=g, device=device)
    t = torch.rand(batch, generator=g, device=device) * 1000
    ctx = torch.randn(batch, s.text, s.config.text_dim, generator=g, device=device)
    return x.to(dtype), t, ctx.to(dtype)


def tokens(s: Sizes, frames: int) -> int:
    p = s.config.patch_size
    return ((frames - 1) // 4 + 1) // p[0] * (s.height // 8 // p[1]) * (s.width // 8 // p[2])


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke: bool = args.smoke
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.dtype = torch.float32 if self.smoke else torch.bfloat16
        self.kernel: str = args.kernel
        self.s = sizes(self.smoke, args.rank)
        self.timer = Timer(self.device, 1 if self.smoke else args.iters, 1 if self.smoke else 3)
        self.out: Path = args.output
        self.results: dict[str, Any] = {"env": environment(self.device), "args": {k: str(v) for k, v in vars(args).items()},
                                        "cases": {}, "errors": {}}
        self.model = build_model(self.s, self.device, self.dtype)
        count = max(self.s.requests_a, self.s.requests_b)
        self.cache_a: tuple[tuple[torch.Tensor, ...], dict[str, float]] | None = None  # (a)'s inputs and base time
        self.loras = [random_lora(self.model, f"lora{i}", self.s.rank, 100 + i, self.dtype) for i in range(count)]

    def record(self, case: str, **data: Any) -> None:
        self.results["cases"][case] = data
        log(f"  {case}: {data}")

    def write(self) -> None:
        self.results["table"] = table(self.results)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "table.md").write_text(self.results["table"] + "\n")

    def section(self, name: str, fn: Callable[[], None]) -> None:
        log(f"[{name}]")
        try:
            with torch.no_grad():
                fn()
        except Exception as exc:  # noqa: BLE001 - record, keep the other sections
            self.results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            log(traceback.format_exc())
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.write()

    # -- the forwards

    def forward(self, x: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.model(*x)

    def per_row(self, x: tuple[torch.Tensor, ...], loras: list[AdapterWeights], kernel: Any = None) -> torch.Tensor:
        routing = RowAdapters.from_stacks([[(lora, 1.0)] for lora in loras], kernel=kernel or self.kernel)
        with rows_adapted(self.model, routing):
            return self.model(*x)

    def alone(self, x: tuple[torch.Tensor, ...], loras: list[AdapterWeights]) -> list[torch.Tensor]:
        return [self.per_row(tuple(t[i : i + 1] for t in x), [lora]) for i, lora in enumerate(loras)]

    def merged(self, x: tuple[torch.Tensor, ...], loras: list[AdapterWeights]) -> list[torch.Tensor]:
        outs = []
        for i, lora in enumerate(loras):
            merge = merge_adapters(self.model, [(lora, 1.0)])
            try:
                outs.append(self.model(*(t[i : i + 1] for t in x)))
            finally:
                merge.restore()
        return outs

    # -- the cases

    def case_a(self) -> None:
        s, n = self.s, self.s.requests_a
        x = inputs(s, n, 1, self.device, self.dtype, seed=1)
        loras = self.loras[:n]
        common = {"requests": n, "shape": f"{s.height}x{s.width}x1", "tokens_per_request": tokens(s, 1)}
        base = self.timer.ms(lambda: self.forward(x))
        per_row = self.timer.ms(lambda: self.per_row(x, loras))
        kept = select_row_kernel(self.kernel)
        per_row_kept = self.timer.ms(lambda: self.per_row(x, loras, kept))
        one = self.timer.ms(lambda: self.alone(x, loras))
        anchors = self.timer.ms(lambda: self.merged(x, loras))
        batched = self.per_row(x, loras)
        alone = torch.cat(self.alone(x, loras))
        merged = torch.cat(self.merged(x, loras))
        effect = max_abs(batched, self.forward(x))  # the LoRAs change the output: the checks below are not vacuous
        self.cache_a = (x, base)
        self.record("a.base", **common, **base)
        self.record("a.per_row", **common, **per_row, throughput_vs_base=round(base["ms"] / per_row["ms"], 3),
                    target_vs_base=0.85, max_abs_vs_alone=max_abs(batched, alone), max_abs_vs_merged=max_abs(batched, merged),
                    max_abs_lora_effect=effect)
        self.record("a.per_row_kept", **common, **per_row_kept, throughput_vs_base=round(base["ms"] / per_row_kept["ms"], 3),
                    kept_stacks=len(kept._stacks) if isinstance(kept, TritonRowKernel) else None)
        self.record("a.one_at_a_time", **common, **one, per_row_speedup=round(one["ms"] / per_row["ms"], 3), target_speedup=3.0)
        self.record("a.adapter_per_batch", **common, **anchors, per_row_speedup=round(anchors["ms"] / per_row["ms"], 3),
                    how="8 batches of 1, each: merge its LoRA, forward, restore" if n == 8 else f"{n} batches of 1")

    def case_b(self) -> None:
        s, n = self.s, self.s.requests_b
        x = inputs(s, n, s.frames, self.device, self.dtype, seed=2)
        loras = self.loras[:n]
        common = {"requests": n, "shape": f"{s.height}x{s.width}x{s.frames}", "tokens_per_request": tokens(s, s.frames)}
        base = self.timer.ms(lambda: self.forward(x))
        per_row = self.timer.ms(lambda: self.per_row(x, loras))
        batched = self.per_row(x, loras)
        alone = torch.cat(self.alone(x, loras))
        self.record("b.base", **common, **base)
        self.record("b.per_row", **common, **per_row, throughput_vs_base=round(base["ms"] / per_row["ms"], 3),
                    target_vs_base=0.9, max_abs_vs_alone=max_abs(batched, alone))

    def case_c(self) -> None:
        s = self.s
        x = inputs(s, 1, s.frames, self.device, self.dtype, seed=3)
        common = {"requests": 1, "shape": f"{s.height}x{s.width}x{s.frames}", "tokens_per_request": tokens(s, s.frames)}
        base = self.timer.ms(lambda: self.forward(x))
        merge = merge_adapters(self.model, [(self.loras[0], 1.0)])
        try:
            merged = self.timer.ms(lambda: self.forward(x))
            merged_out = self.forward(x)
        finally:
            merge.restore()
        per_row_out = self.per_row(x, self.loras[0:1])

        def transition() -> None:
            merge_adapters(self.model, [(self.loras[0], 1.0)]).restore()

        switch = self.timer.ms(transition)
        self.record("c.base", **common, **base)
        self.record("c.merged", **common, **merged, vs_base=round(merged["ms"] / base["ms"], 4), target_within=0.02,
                    max_abs_vs_per_row=max_abs(merged_out, per_row_out), merge_and_restore_ms=switch["ms"])

    def case_profile(self) -> None:
        """Where a.per_row's extra time goes: device time per kernel, base forward vs per-row forward (one each)."""
        from torch.profiler import ProfilerActivity, profile

        if self.device.type != "cuda":
            self.record("a.profile", skipped="the kernel breakdown needs CUDA")
            return
        x, _ = self.cache_a or (inputs(self.s, self.s.requests_a, 1, self.device, self.dtype, 1), None)
        loras = self.loras[: self.s.requests_a]
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        summary: dict[str, Any] = {}
        for name, fn in (("base", lambda: self.forward(x)), ("per_row", lambda: self.per_row(x, loras))):
            fn()
            self.timer.sync()
            with profile(activities=activities) as prof:
                fn()
                self.timer.sync()
            rows = []
            for event in prof.key_averages():
                device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0) or 0
                if device_us > 0 and not event.key.startswith(("aten::", "cuda", "ProfilerStep")):
                    rows.append((event.key[:90], round(device_us / 1000, 3), event.count))
            rows.sort(key=lambda r: -r[1])
            summary[name] = {"device_ms_total": round(sum(r[1] for r in rows), 3), "kernels": len(rows),
                             "launches": sum(r[2] for r in rows), "top": rows[:12]}
        self.record("a.profile", **summary)

    def case_diffusers(self) -> None:
        try:
            from diffusers import WanTransformer3DModel
        except Exception as exc:  # noqa: BLE001
            self.record("diffusers.base", skipped=f"diffusers not importable: {type(exc).__name__}: {exc}")
            return
        x, fv_base = self.cache_a or (inputs(self.s, self.s.requests_a, 1, self.device, self.dtype, 1), None)
        with torch.device(self.device):
            twin = WanTransformer3DModel(**self.model.config.to_diffusers_config())
        twin.load_state_dict(self.model.state_dict(), strict=True)
        twin = cast_for_inference(twin, self.dtype).eval().requires_grad_(False)
        timing = self.timer.ms(lambda: twin(*x, return_dict=False))
        data: dict[str, Any] = {"requests": x[0].shape[0], "shape": f"{self.s.height}x{self.s.width}x1", **timing,
                                "max_abs_vs_fv": max_abs(twin(*x, return_dict=False)[0], self.forward(x))}
        if fv_base is not None:
            data["fv_base_over_diffusers"] = round(fv_base["ms"] / timing["ms"], 3)
        self.record("diffusers.base", **data)


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    for name in ("triton", "diffusers"):
        try:
            env[name] = getattr(__import__(name), "__version__", "present")
        except Exception as exc:  # noqa: BLE001
            env[name] = f"absent ({type(exc).__name__})"
    return env


def table(results: dict[str, Any]) -> str:
    lines = ["| case | requests | shape | ms / forward | vs reference | target |", "|---|---|---|---|---|---|"]
    refs = (("throughput_vs_base", "x base throughput", "target_vs_base", ">= {}x"),
            ("per_row_speedup", "per-row batch {}x faster than this", "target_speedup", ">= {}x"),
            ("vs_base", "x base time", "target_within", "within {:.0%}"),
            ("fv_base_over_diffusers", "fv base / diffusers", None, ""))  # fmt: skip
    for case, row in results["cases"].items():
        if "ms" not in row:
            lines.append(f"| {case} | | | {row.get('skipped', '')} | | |")
            continue
        versus, target = "", ""
        for key, label, target_key, fmt in refs:
            if key in row:
                versus = label.format(row[key]) if "{}" in label else f"{row[key]} {label}"
                target = fmt.format(row[target_key]) if target_key in row else ""
        lines.append(f"| {case} | {row.get('requests', '')} | {row.get('shape', '')} | {row['ms']:.2f} | {versus} | {target} |")
    for name, error in results["errors"].items():
        lines.append(f"| {name} | | | failed: {error[:120]} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="directory for results.json and table.md")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in fp32 (what the smoke test runs)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--kernel", choices=("auto", "torch", "triton"), default="auto",
                        help="the per-row kernel (auto: Triton on CUDA when importable)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("a", "b", "c", "diffusers", "profile"))
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        args.output.mkdir(parents=True, exist_ok=True)
        reason = "skipped: bench_lora.py times the H200 run and needs CUDA, which this machine does not have (--smoke runs it on CPU)"
        (args.output / "results.json").write_text(json.dumps({"skipped": reason}, indent=2))
        print(reason)
        return 0
    run = Run(args)
    log(f"bench_lora: {run.device}, {run.dtype}, rank {run.s.rank}, kernel {run.kernel}")
    for name, fn in (("a", run.case_a), ("b", run.case_b), ("c", run.case_c), ("diffusers", run.case_diffusers),
                     ("profile", run.case_profile)):
        if name not in args.skip:
            run.section(name, fn)
    print(run.results["table"])
    return 1 if run.results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
