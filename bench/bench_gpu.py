"""GPU benchmark of fv-wan against diffusers in one run (issue 9): denoise step, batching, VAE, end to end.

Builds fv's Wan2.1-1.3B DiT and diffusers' ``WanTransformer3DModel`` with identical random
weights (generated on the GPU) and reports ms per denoise step at batch 1 and CFG batch 2
for each fv tier (eager, eager+fused, compiled blocks, CUDA graph) and diffusers eager
(compiled too with ``--diffusers-compile``), the fv/diffusers ratio, achieved TFLOP/s and
the ratio to the counted floor (counted FLOPs / the measured 8192^3 bf16 matmul rate),
peak memory and compile/capture time. Under the Engine: throughput of 1/8/32 concurrent
single-frame 480x832 requests with cross-request batching against one-at-a-time dispatch,
VAE decode of the 81-frame latent (fv vs diffusers), end-to-end fastwan2.1-t2v-1.3b at
448x832x61 in 3 steps (real-size UMT5 with random weights) and the Engine's scheduling
overhead. Every section has its own time budget and failure isolation; results are written
after each section. ``--smoke`` runs every section at tiny sizes on CPU.

    python bench/bench_gpu.py out/gpu            # on the H200, about 5-8 minutes
    python bench/bench_gpu.py /tmp/gpu-smoke --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from timing import timed_calls_ms  # bench/, beside this script

from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import ModelInstance
from fv_kernel.card.spec import ModelCard
from fv_kernel.compute.compile import CompileCache, CompileKey, ComputeOptions, GraphedStep, compile_blocks
from fv_kernel.compute.fused import select_fused_ops
from fv_wan.cards import wan_cards
from fv_wan.instance import _component_dtype, configure_transformer, wan_ops
from fv_wan.models.encoders import ByteTokenizer, WanTextEncoder
from fv_wan.models.transformer import WanTransformer, WanTransformerConfig, cast_for_inference, count_forward_flops
from fv_wan.models.vae import WanVAE, WanVAEConfig
from op_times import OpTimes  # bench/, beside this script
from random_weights import seeded_manifest

GiB = 2**30


class SectionTimeout(Exception):
    """A section ran past its own time budget."""


class Bench:
    """Shared state: device, sizes, the results dict (written after every section), the global deadline."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke: bool = args.smoke
        self.device = torch.device("cpu" if self.smoke or not torch.cuda.is_available() else "cuda")
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.out: Path = args.output
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict[str, Any] = {"env": environment(self.device), "args": {k: str(v) for k, v in vars(args).items()},
                                        "sections": {}, "errors": {}}
        self.rows: list[dict[str, Any]] = []  # the denoise-step table
        self.cache: dict[str, Any] = {}

    # -- bookkeeping

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def section(self, name: str, budget_s: float, fn: Callable[[], dict[str, Any] | None]) -> None:
        budget = min(budget_s, self.remaining() - 5)
        if budget < 5:
            self.results["errors"][name] = f"skipped: {self.remaining():.0f} s of the total budget left"
            log(f"[{name}] skipped (no time left)")
            self.write()
            return
        log(f"[{name}] start (budget {budget:.0f} s, {self.remaining():.0f} s left in total)")
        started = time.perf_counter()
        try:
            with alarm(budget):
                data = fn()
            self.results["sections"][name] = {**(data or {}), "section_s": round(time.perf_counter() - started, 2)}
        except BaseException as exc:  # noqa: BLE001 - record and move on, whatever broke
            if isinstance(exc, KeyboardInterrupt):
                raise
            self.results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            (self.out / "errors.log").open("a").write(f"== {name}\n{traceback.format_exc()}\n")
            log(f"[{name}] FAILED: {type(exc).__name__}: {exc}"[:500])
        finally:
            self.free()
        log(f"[{name}] done in {time.perf_counter() - started:.1f} s")
        self.write()

    def write(self) -> None:
        self.results["table"] = table(self)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "table.md").write_text(self.results["table"] + "\n")

    def free(self) -> None:
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # -- timing

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], Any], *, warmup: int = 1, iters: int = 3) -> dict[str, float]:
        """Median and spread of ``fn`` in ms (CUDA events on GPU), plus peak memory over the timed calls."""
        for _ in range(warmup):
            fn()
        self.sync()
        self.reset_peak()
        times = timed_calls_ms(fn, self.device, iters)
        return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times), "iters": iters,
                "peak_gib": self.peak_gib()}

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return round(torch.cuda.max_memory_allocated() / GiB, 3) if self.device.type == "cuda" else None


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in the main thread after ``seconds`` (Python-level; a kernel in flight finishes first)."""

    def fire(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"section ran past its {seconds:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    for name in ("triton", "diffusers", "transformers", "flash_attn", "flash_attn_interface"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "present")
        except Exception as exc:  # noqa: BLE001
            env[name] = f"absent ({type(exc).__name__})"
    return env


# --------------------------------------------------------------------------- sizes


def dit_config(b: Bench) -> WanTransformerConfig:
    return WanTransformerConfig.tiny() if b.smoke else WanTransformerConfig.wan21_t2v_1_3b()


def dit_latent_shape(b: Bench) -> tuple[int, int, int]:
    return (3, 8, 6) if b.smoke else (21, 60, 104)  # 480x832, 81 frames


def text_len(b: Bench) -> int:
    return 10 if b.smoke else 512


@functools.lru_cache(maxsize=None)
def _attention_from_manifest(name: str) -> type:
    """The driver class from the kernel's own fv-plugin.yaml, for checkouts run without installed metadata."""
    import yaml

    import fv_kernel
    from fv_kernel.card.refs import import_object

    manifest = yaml.safe_load((Path(fv_kernel.__file__).parent / "fv-plugin.yaml").read_text())
    for entry in manifest["contributions"]["attention_backends"]:
        if entry["name"] == name:
            return import_object(entry["target"])  # type: ignore[no-any-return]
    raise KeyError(f"attention backend {name!r} is in neither the installed entry points nor fv-plugin.yaml")


def attention_fn(b: Bench, name: str) -> tuple[Callable[..., torch.Tensor], str]:
    """The attention callable for ``name`` via the driver registry (manifest fallback); on CPU, plain sdpa."""
    from fv_kernel.compute.attention_backends import attention_callable
    from fv_kernel.plugins.registry import load_attention_backend
    from fv_kernel.plugins.errors import UnknownDriverError

    if b.device.type != "cuda" and name not in ("sdpa", "sdpa_math"):
        name = "sdpa"
    try:
        return attention_callable(load_attention_backend(name)), name
    except UnknownDriverError:
        return attention_callable(_attention_from_manifest(name)()), f"{name} (from manifest)"


# --------------------------------------------------------------------------- model builders (random weights on the device)


def _randomise_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter redrawn on its own device: N(0, 1/fan_in) for matrices, small N for vectors."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else p.numel()
            std = fan_in**-0.5 if p.dim() > 1 else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)


def build_dit(b: Bench, config: WanTransformerConfig, seed: int = 0) -> WanTransformer:
    with torch.device(b.device):
        model = WanTransformer(config)
    _randomise_(model, seed)
    model.rope.build_tables(b.device)
    return cast_for_inference(model, b.dtype).eval().requires_grad_(False)


def build_diffusers_twin(b: Bench, model: WanTransformer) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    with torch.device(b.device):
        twin = WanTransformer3DModel(**model.config.to_diffusers_config())
    twin.load_state_dict(model.state_dict(), strict=True)
    return cast_for_inference(twin, b.dtype).eval().requires_grad_(False)


def dit_inputs(b: Bench, batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    config = dit_config(b)
    g = torch.Generator(device=b.device).manual_seed(seed)
    f, h, w = dit_latent_shape(b)
    x = torch.randn(batch, config.in_channels, f, h, w, generator=g, device=b.device).to(b.dtype)
    t = torch.rand(batch, generator=g, device=b.device) * 1000
    ctx = torch.randn(batch, text_len(b), config.text_dim, generator=g, device=b.device).to(b.dtype)
    return x, t, ctx


def rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- sections


def section_matmul(b: Bench) -> dict[str, Any]:
    n = 256 if b.smoke else 8192
    g = torch.Generator(device=b.device).manual_seed(0)
    mats = [torch.randn(n, n, generator=g, device=b.device).to(b.dtype) for _ in range(4)]  # rotate: not one cached pair
    state = {"i": 0}

    def mm() -> None:
        i = state["i"] = (state["i"] + 1) % 3
        torch.mm(mats[i], mats[i + 1])

    timing = b.time_ms(mm, warmup=3, iters=10 if b.smoke else 30)
    rate = 2 * n**3 / (timing["ms"] * 1e-3) / 1e12
    b.cache["matmul_tflops"] = rate
    return {"n": n, "dtype": str(b.dtype), **timing, "tflops": round(rate, 1)}


def _step_row(b: Bench, impl: str, batch: int, timing: dict[str, Any], **extra: Any) -> dict[str, Any]:
    config = dit_config(b)
    f, h, w = dit_latent_shape(b)
    p = config.patch_size
    tokens = (f // p[0]) * (h // p[1]) * (w // p[2])
    flops = count_forward_flops(config, tokens, text_len(b), batch_size=batch)
    rate = b.cache.get("matmul_tflops")
    row = {"impl": impl, "batch": batch, "tokens": tokens, "ms": round(timing["ms"], 2),
           "ms_spread": [round(timing["ms_min"], 2), round(timing["ms_max"], 2)], "peak_gib": timing["peak_gib"],
           "tflop": round(flops / 1e12, 3), "achieved_tflops": round(flops / (timing["ms"] * 1e-3) / 1e12, 1), **extra}
    if rate:
        floor_ms = flops / (rate * 1e12) * 1e3
        row["floor_ms"] = round(floor_ms, 2)
        row["x_floor"] = round(timing["ms"] / floor_ms, 3)
    b.rows.append(row)
    return row


def section_step_batching(b: Bench) -> dict[str, Any]:
    """Cross-request batching of one denoise step: n single-frame 480x832 requests' DiT steps fused into
    one call (what the Engine runs under ``batching: throughput``) vs the same steps one request at a time."""
    config = dit_config(b)
    model = b.cache.get("dit") or build_dit(b, config)
    b.cache["dit"] = model
    fn, backend = attention_fn(b, b.args.attention)
    model.set_attention_fn(fn)
    model.set_fused_ops(None)
    h, w = (64, 64) if b.smoke else (480, 832)
    text = 16 if b.smoke else 512
    out: dict[str, Any] = {"shape": f"{h}x{w}x1", "backend": backend, "tokens_per_request": (h // 16) * (w // 16)}
    counts = (1, 2, 4) if b.smoke else (1, 8, 32)
    with torch.no_grad():
        for n in counts:
            x = torch.randn(n, config.in_channels, 1, h // 8, w // 8, device=b.device, dtype=b.dtype)
            t = torch.full((n,), 500.0, device=b.device)
            ctx = torch.randn(n, text, config.text_dim, device=b.device, dtype=b.dtype)
            fused = b.time_ms(lambda: model(x, t, ctx), iters=3 if b.smoke else 5)
            single = b.time_ms(lambda: [model(x[i : i + 1], t[i : i + 1], ctx[i : i + 1]) for i in range(n)], iters=2 if b.smoke else 3)
            out[str(n)] = {"fused_ms": round(fused["ms"], 2), "one_at_a_time_ms": round(single["ms"], 2),
                           "throughput_x": round(single["ms"] / fused["ms"], 3)}
    return out


def section_dit(b: Bench) -> dict[str, Any]:
    """fv eager (with the chosen backend), eager+fused, and diffusers eager, at batch 1 and CFG batch 2."""
    config = dit_config(b)
    model = build_dit(b, config)
    b.cache["dit"] = model
    fn, backend = attention_fn(b, b.args.attention)
    out: dict[str, Any] = {"backend": backend, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    iters = 2 if b.smoke else b.args.iters
    reference: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for batch in (1, 2):
            inputs = dit_inputs(b, batch)
            model.set_attention_fn(fn)
            model.set_fused_ops(None)
            reference[batch] = model(*inputs).float()
            _step_row(b, f"fv eager ({backend})", batch, b.time_ms(lambda: model(*inputs), iters=iters))
        b.cache["dit_reference"] = reference
        fused = select_fused_ops(b.device, "auto" if b.device.type == "cuda" else "torch")
        if fused is not None:
            model.set_fused_ops(fused)
            for batch in (1, 2):
                inputs = dit_inputs(b, batch)
                err = rel_error(model(*inputs).float(), reference[batch])
                _step_row(b, f"fv eager+fused[{fused.name}] ({backend})", batch,
                          b.time_ms(lambda: model(*inputs), iters=iters), rel_err_vs_eager=f"{err:.2e}")
            model.set_fused_ops(None)
        else:
            out["fused"] = "skipped: no triton"
        # Same kernels, default SDPA dispatch: what fv runs with attention_backend=sdpa.
        if backend != "sdpa":
            model.set_attention_fn(torch.nn.functional.scaled_dot_product_attention)
            inputs = dit_inputs(b, 1)
            _step_row(b, "fv eager (sdpa default)", 1, b.time_ms(lambda: model(*inputs), iters=iters))
            model.set_attention_fn(fn)
    return out


#: What each part of a denoise step is made of, as lower-case substrings of kernel names (CUDA) or op
#: names (CPU); the first part that matches takes the kernel. cuDNN's SDPA kernels carry "sdpa" / "fprop".
STEP_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("sdpa", "fprop", "fmha", "flash", "attention")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("other", ("",)),
)


def step_parts(b: Bench, fn: Callable[[], Any]) -> dict[str, Any]:
    """Device milliseconds of one call of ``fn`` split into STEP_PARTS (CPU: self time of the aten ops),
    beside its wall time: the difference is time the device sat idle."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = b.device.type == "cuda"
    fn()
    b.sync()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        b.sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    parts = {label: 0.0 for label, _ in STEP_PARTS}
    by_name: dict[tuple[str, str], float] = {}
    kernels = 0
    for event in prof.events():
        if cuda and event.device_type != DeviceType.CUDA:
            continue
        if not cuda and not event.name.startswith("aten::"):
            continue
        name = event.name.lower()
        label = next(label for label, keys in STEP_PARTS if any(key in name for key in keys))
        ms = (event.time_range.elapsed_us() if cuda else event.self_cpu_time_total) / 1e3
        parts[label] += ms
        by_name[(event.name[:80], label)] = by_name.get((event.name[:80], label), 0.0) + ms
        kernels += 1
    busy = sum(parts.values())
    # The largest kernels with the part each was counted in, so a misread name shows.
    top = sorted(by_name.items(), key=lambda item: -item[1])[:8]
    return {**{f"{k}_ms": round(v, 2) for k, v in parts.items()}, "busy_ms": round(busy, 2), "wall_ms": round(wall_ms, 2),
            "kernels": kernels, "profiled": "CUDA kernels" if cuda else "CPU aten ops (self time)",
            "top": [{"name": name, "part": label, "ms": round(ms, 2)} for (name, label), ms in top]}


def section_step_parts(b: Bench) -> dict[str, Any]:
    """One batch-1 denoise step at 480x832x81, fv eager, fv fused (Triton glue) and diffusers eager,
    split into attention, matmul and the rest (issue 19: what bounds the step, against cuDNN attention)."""
    model: WanTransformer = b.cache["dit"]
    fn, backend = attention_fn(b, b.args.attention)
    model.set_attention_fn(fn)
    inputs = dit_inputs(b, 1)
    out: dict[str, Any] = {"backend": backend}
    with torch.no_grad():
        model.set_fused_ops(None)
        out["fv eager"] = step_parts(b, lambda: model(*inputs))
        fused = select_fused_ops(b.device, "auto" if b.device.type == "cuda" else "torch")
        if fused is not None:
            model.set_fused_ops(fused)
            out[f"fv fused[{fused.name}]"] = step_parts(b, lambda: model(*inputs))
            model.set_fused_ops(None)
        try:
            twin = build_diffusers_twin(b, model)
        except Exception as exc:  # noqa: BLE001
            out["diffusers eager"] = f"skipped: {type(exc).__name__}: {exc}"
        else:
            out["diffusers eager"] = step_parts(b, lambda: twin(*inputs, return_dict=False))
            del twin
    return out


def section_diffusers(b: Bench) -> dict[str, Any]:
    try:
        import diffusers  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"diffusers not importable: {type(exc).__name__}: {exc}"}
    model: WanTransformer = b.cache["dit"]
    twin = build_diffusers_twin(b, model)
    iters = 2 if b.smoke else b.args.iters
    out: dict[str, Any] = {}
    with torch.no_grad():
        for batch in (1, 2):
            inputs = dit_inputs(b, batch)
            got = twin(*inputs, return_dict=False)[0].float()
            ref = b.cache.get("dit_reference", {}).get(batch)
            diff = float((got - ref).abs().max()) if ref is not None else None
            _step_row(b, "diffusers eager", batch, b.time_ms(lambda: twin(*inputs, return_dict=False), iters=iters),
                      max_abs_diff_vs_fv=diff)
        if b.args.diffusers_compile:
            twin.compile()  # whole-model compile as diffusers users do; a large compile time is expected
            inputs = dit_inputs(b, 1)
            t0 = time.perf_counter()
            twin(*inputs, return_dict=False)
            b.sync()
            compile_s = time.perf_counter() - t0
            _step_row(b, "diffusers compiled", 1, b.time_ms(lambda: twin(*inputs, return_dict=False), iters=iters),
                      compile_s=round(compile_s, 1))
    del twin
    return out


def section_compiled(b: Bench) -> dict[str, Any]:
    model: WanTransformer = b.cache["dit"]
    fn, backend = attention_fn(b, b.args.attention)
    model.set_attention_fn(fn)
    model.set_fused_ops(None)
    compile_blocks(model.blocks, backend="eager" if b.smoke else "inductor")
    iters = 2 if b.smoke else b.args.iters
    out: dict[str, Any] = {}
    try:
        with torch.no_grad():
            for batch in (1, 2):
                inputs = dit_inputs(b, batch)
                t0 = time.perf_counter()
                result = model(*inputs).float()
                b.sync()
                compile_s = time.perf_counter() - t0
                ref = b.cache.get("dit_reference", {}).get(batch)
                _step_row(b, f"fv compiled blocks ({backend})", batch, b.time_ms(lambda: model(*inputs), iters=iters),
                          compile_s=round(compile_s, 1), rel_err_vs_eager=f"{rel_error(result, ref):.2e}" if ref is not None else None)
    finally:
        for block in model.blocks:  # back to eager for later sections
            block._compiled_call_impl = None
    return out


def section_graphs(b: Bench) -> dict[str, Any]:
    if b.device.type != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device"}
    model: WanTransformer = b.cache["dit"]
    fn, backend = attention_fn(b, b.args.attention)
    model.set_attention_fn(fn)
    out: dict[str, Any] = {}
    for fused_mode in ("off", "auto"):
        fused = select_fused_ops(b.device, fused_mode)
        if fused_mode == "auto" and fused is None:
            continue
        model.set_fused_ops(fused)
        label = "fused+graph" if fused is not None else "graph"
        key = CompileKey(model="wan2.1-t2v-1.3b", component="transformer", kind="diffusion_step",
                         precision="bf16", backend=backend, tier=label)
        graphed = GraphedStep(lambda d: {"v": model(d["x"], d["t"], d["context"])}, key_base=key,
                              cache=CompileCache(), buckets=(1, 2))
        with torch.no_grad():
            for batch in (1, 2):
                x, t, ctx = dit_inputs(b, batch)
                batch_inputs = {"x": x, "t": t, "context": ctx}
                t0 = time.perf_counter()
                graphed.capture(batch_inputs)
                b.sync()
                capture_s = time.perf_counter() - t0
                result = graphed(batch_inputs)["v"].float()
                ref = b.cache.get("dit_reference", {}).get(batch)
                _step_row(b, f"fv {label} ({backend})", batch,
                          b.time_ms(lambda: graphed(batch_inputs), iters=2 if b.smoke else b.args.iters),
                          capture_s=round(capture_s, 1),
                          rel_err_vs_eager=f"{rel_error(result, ref):.2e}" if ref is not None else None)
        del graphed
        b.free()
    model.set_fused_ops(None)
    return out


# -- Engine sections: a real-size instance of the card with random weights built on the device


def engine_card(b: Bench) -> ModelCard:
    wanted = "fastwan-tiny" if b.smoke else "fastwan2.1-t2v-1.3b"
    # build_engine_instance's loader makes every component on random weights: no checkpoint to look for.
    return seeded_manifest(next(c for c in wan_cards() if c.model_id == wanted))


def _real_text_encoder(b: Bench, dtype: torch.dtype) -> WanTextEncoder:
    """UMT5-XXL encoder (Wan's text tower: 24 layers, d_model 4096) with random weights, built on the device."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                        relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
                        feed_forward_proj="gated-gelu", pad_token_id=ByteTokenizer.pad_token_id,
                        eos_token_id=ByteTokenizer.eos_token_id)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(b.device):
            model = UMT5EncoderModel(config)
    finally:
        torch.set_default_dtype(previous)
    _randomise_(model, 3)
    # Byte-level ids are a subset of the real vocabulary: the encoder's cost is the real one.
    return WanTextEncoder(model.to(dtype).eval().requires_grad_(False), ByteTokenizer())


def build_engine_instance(b: Bench, compute: ComputeOptions | None, attention: str | None = None, *,
                          dense_beside_vsa: str = "sdpa_cudnn") -> ModelInstance:
    """The engine card on random weights. ``attention``: the DiT's driver (default ``--attention``); ``vsa``
    takes the card's recipe (``assumes_attention``: sparsity, tile) and the DiT's gates, as a deployment does,
    with ``dense_beside_vsa`` for the cross-attention."""
    card = engine_card(b)
    attention = attention or b.args.attention
    sparse = attention == "vsa" and b.device.type == "cuda"
    fn, backend = attention_fn(b, dense_beside_vsa if sparse else attention)
    options = InstanceOptions(device=str(b.device), precision="fp32" if b.smoke else "bf16",
                              attention_backend=backend.split(" ")[0])
    # The driver was resolved above (registry, or the manifest when this checkout is not installed).
    plain = options.model_copy(update={"attention_backend": "sdpa"})

    def load(component_id: str) -> Any:
        spec = card.components[component_id]
        dtype = _component_dtype(card, component_id, options)
        if spec.kind == "dit":
            model = b.cache.get("dit") if not b.smoke else None
            if model is None or model.config != WanTransformerConfig.from_diffusers_config(spec.config):
                model = build_dit(b, WanTransformerConfig.from_diffusers_config(spec.config))
            model.set_fused_ops(None)
            model.set_video_attention(None)
            model = configure_transformer(model, plain, compute)
            model.set_attention_fn(fn)  # cross-attention (and, dense, self-attention)
            if sparse:
                model = configure_transformer(model, plain.model_copy(update={"attention_backend": "vsa"}), None,
                                              assumption=card.recipe.assumes_attention)
            return model
        if spec.kind == "vae":
            with torch.device(b.device):
                vae = WanVAE(WanVAEConfig.from_diffusers_config(spec.config))
            _randomise_(vae, 2)
            vae.encoder = None  # type: ignore[assignment]
            vae.quant_conv = None  # type: ignore[assignment]
            return vae.to(dtype).eval().requires_grad_(False)
        if spec.kind == "text_encoder":
            if b.smoke:
                return WanTextEncoder.tiny(3, **spec.config.get("tiny", {})).to(b.device, dtype).eval()
            return _real_text_encoder(b, dtype)
        raise ValueError(f"unexpected component kind {spec.kind!r}")

    ops_builder = functools.partial(wan_ops, compute=compute, compile_cache=CompileCache())
    return ModelInstance(card=card, options=options, component_loader=load, ops_builder=ops_builder,
                         weights_version="random-on-device")


def _requests(b: Bench, n: int, *, height: int, width: int, frames: int, tag: str) -> list[Any]:
    from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart

    return [Request(request_id=f"{tag}-{i}", model=engine_card(b).model_id, task=TaskType.TEXT_TO_VIDEO,
                    inputs=(TextPart(text=f"a lighthouse at dusk, waves, take {i}"),),
                    diffusion=DiffusionParams(height=height, width=width, frames=frames, seed=i))
            for i in range(n)]


def _run_engine(b: Bench, instance: ModelInstance, requests: list[Any], *, batched: bool,
                config: Any = None) -> dict[str, Any]:
    from fv_kernel.runtime.engine import Engine, run_concurrently
    from fv_kernel.runtime.scheduler import SchedulerConfig

    if config is None:
        config = (SchedulerConfig(scheduling="step", batching="throughput", device_thread=False, max_queue=4096)
                  if batched else SchedulerConfig(scheduling="request", device_thread=False, max_queue=4096))
    times = OpTimes()
    engine = Engine(config, observers=[times])
    engine.add_instance(instance)
    b.sync()
    t0 = time.perf_counter()
    results = run_concurrently(engine, requests)
    b.sync()
    wall = time.perf_counter() - t0
    failed = [f"{r.request_id}: {r.error.message if r.error else r.status}" for r in results if r.status != "completed"]
    m = engine.metrics
    return {"requests": len(requests), "wall_s": round(wall, 3), "throughput_rps": round(len(requests) / wall, 3),
            "failed": failed[:3], "batches_by_size": dict(sorted(m.batches_by_size.items())),
            "scheduler_s": round(m.scheduler_seconds, 4), "loop_host_s": round(m.loop_host_seconds, 4),
            "execute_s": round(m.execute_seconds, 4),
            "scheduler_share_of_execute": round(m.scheduler_seconds / m.execute_seconds, 5) if m.execute_seconds else None,
            "loop_host_share_of_execute": round(m.loop_host_seconds / m.execute_seconds, 5) if m.execute_seconds else None,
            "mean_batch_ms": round(1000 * m.execute_seconds / max(1, sum(m.batches_by_size.values())), 2),
            "overlapped_batches": m.overlapped_batches,
            "op_device_ms": {op: round(1000 * s, 1) for op, s in sorted(times.seconds.items())}}


def section_engine_throughput(b: Bench) -> dict[str, Any]:
    instance = b.cache.get("engine_instance") or build_engine_instance(b, None)
    b.cache["engine_instance"] = instance
    h, w = (64, 64) if b.smoke else (480, 832)
    counts = (1, 2, 4) if b.smoke else tuple(b.args.concurrency)
    # Warm-up: loads every component and the allocator, outside the numbers.
    _run_engine(b, instance, _requests(b, 1, height=h, width=w, frames=1, tag="warm"), batched=True)
    rows = {}
    for n in counts:
        for batched in (True, False):
            mode = "batched" if batched else "one-at-a-time"
            rows[f"{n}:{mode}"] = _run_engine(b, instance, _requests(b, n, height=h, width=w, frames=1, tag=f"{mode}{n}"),
                                              batched=batched)
        rows[f"{n}:speedup"] = round(rows[f"{n}:batched"]["throughput_rps"] / rows[f"{n}:one-at-a-time"]["throughput_rps"], 3)
    return {"card": instance.model_id, "shape": f"{h}x{w}x1", "steps": engine_card(b).capabilities.defaults.steps, **rows}


def section_e2e(b: Bench) -> dict[str, Any]:
    # The card as its recipe made it: fastwan's DiT under VSA (--e2e-attention), not the dense --attention.
    b.cache.pop("engine_instance", None)  # the throughput section's (dense) instance: its memory back first
    b.free()
    instance = build_engine_instance(b, None, attention=b.args.e2e_attention)
    defaults = engine_card(b).capabilities.defaults
    h, w, f = defaults.height, defaults.width, defaults.frames
    warm = _run_engine(b, instance, _requests(b, 1, height=h, width=w, frames=f, tag="e2e-warm"), batched=False)
    b.reset_peak()
    timed = _run_engine(b, instance, _requests(b, 1, height=h, width=w, frames=f, tag="e2e"), batched=False)
    attention = b.args.e2e_attention if b.args.e2e_attention != "vsa" or b.device.type == "cuda" else "dense (vsa needs CUDA)"
    out = {"card": instance.model_id, "shape": f"{h}x{w}x{f}", "steps": defaults.steps, "attention": attention,
           "warm_wall_s": warm["wall_s"], **timed, "peak_gib": b.peak_gib()}
    fused = select_fused_ops(b.device, "triton") if b.device.type == "cuda" else None
    if fused is not None:
        # The same request with the fused tier on (DiT glue and the VAE decoder's norm + SiLU), as a deployment
        # whose parity record passes the tier runs it.
        for component_id in ("transformer", "vae_decoder"):
            instance.component(component_id).set_fused_ops(fused)
        _run_engine(b, instance, _requests(b, 1, height=h, width=w, frames=f, tag="e2e-fused-warm"), batched=False)
        out["fused"] = _run_engine(b, instance, _requests(b, 1, height=h, width=w, frames=f, tag="e2e-fused"), batched=False)
    if b.device.type == "cuda":
        # The graphs tier (each denoise forward replayed as a CUDA graph, VAE eager): identical to eager on
        # this card over its trajectory (bench/records/tier_parity_h200.json), so a deployment may select it.
        del instance
        b.free()
        instance = build_engine_instance(b, ComputeOptions(cuda_graphs=True), attention=b.args.e2e_attention)
        _run_engine(b, instance, _requests(b, 1, height=h, width=w, frames=f, tag="e2e-graphs-warm"), batched=False)
        out["graphs"] = _run_engine(b, instance, _requests(b, 1, height=h, width=w, frames=f, tag="e2e-graphs"), batched=False)
    return out


def _run_staggered(b: Bench, instance: ModelInstance, requests: list[Any], interval_s: float,
                   config: Any) -> dict[str, Any]:
    """``requests`` arriving ``interval_s`` apart on one engine: wall from the first arrival to the last
    completion, each request's latency, and how many batches ran beside the other lane's."""
    import asyncio

    from fv_kernel.runtime.engine import Engine

    engine = Engine(config)
    engine.add_instance(instance)

    async def arrive_and_wait() -> list[tuple[Any, float]]:
        async def one(request: Any, delay: float) -> tuple[Any, float]:
            await asyncio.sleep(delay)
            start = time.perf_counter()
            result = await engine.generate_async(request)
            b.sync()
            return result, time.perf_counter() - start

        async with engine.running():
            return list(await asyncio.gather(*(one(r, i * interval_s) for i, r in enumerate(requests))))

    b.sync()
    t0 = time.perf_counter()
    done = asyncio.run(arrive_and_wait())
    wall = time.perf_counter() - t0
    failed = [f"{r.request_id}: {r.error.message if r.error else r.status}" for r, _ in done if r.status != "completed"]
    return {"wall_s": round(wall, 3), "latency_s": [round(s, 3) for _, s in done], "failed": failed[:3],
            "overlapped_batches": engine.metrics.overlapped_batches}


def section_overlap(b: Bench) -> dict[str, Any]:
    """FastWan requests arriving one denoise apart, on one device lane and with the VAE decode on a
    second lane (``scheduler.overlap_kinds: [vae_tile]``): one request's decode beside the next one's denoise."""
    from fv_kernel.loop.plan import WorkKind
    from fv_kernel.runtime.scheduler import SchedulerConfig

    b.cache.pop("engine_instance", None)
    b.free()
    # A second lane refuses a driver that pins SDPA's kernel through torch's process-wide flags
    # (sdpa_cudnn): the dense attention is the default driver, which leaves the pick to PyTorch.
    attention = b.args.e2e_attention if b.args.e2e_attention == "vsa" else "sdpa"
    instance = build_engine_instance(b, None, attention=attention, dense_beside_vsa="sdpa")
    defaults = engine_card(b).capabilities.defaults
    h, w, f = (defaults.height, defaults.width, defaults.frames)
    n = 3 if b.smoke else b.args.overlap_requests
    configs = {
        "one_lane": SchedulerConfig(scheduling="step", batching="exact", max_queue=4096),
        "overlap_lane": SchedulerConfig(scheduling="step", batching="exact", max_queue=4096,
                                        overlap_kinds=(WorkKind.VAE_TILE,)),
    }
    # Twice: the first request's device times include the kernels' first calls (autotuning, loading).
    for tag in ("ov-cold", "ov-warm"):
        warm = _run_engine(b, instance, _requests(b, 1, height=h, width=w, frames=f, tag=tag), batched=False,
                           config=configs["overlap_lane"])
    # Arrivals one request's text encode and denoise apart: the next request denoises while this one decodes.
    interval = sum(ms for op, ms in warm["op_device_ms"].items() if not op.startswith("vae")) / 1000.0
    out: dict[str, Any] = {"card": instance.model_id, "shape": f"{h}x{w}x{f}", "requests": n,
                           "attention": f"{attention} (dense: sdpa)" if attention == "vsa" else attention,
                           "arrival_interval_s": round(interval, 3), "single_request": warm}
    for round_ in range(2):  # alternating, so neither row always runs on the warmer device
        for name, config in configs.items():
            b.reset_peak()
            row = _run_staggered(b, instance, _requests(b, n, height=h, width=w, frames=f, tag=f"ov-{name}{round_}"),
                                 interval, config)
            row["peak_gib"] = b.peak_gib()
            out.setdefault(name, []).append(row)
    walls = {name: min(r["wall_s"] for r in out[name]) for name in configs}
    out["wall_ratio_overlap_vs_one_lane"] = round(walls["overlap_lane"] / walls["one_lane"], 3)
    return out


def section_vae(b: Bench) -> dict[str, Any]:
    config = WanVAEConfig.wan21() if not b.smoke else next(
        WanVAEConfig.from_diffusers_config(c.components["vae_decoder"].config) for c in wan_cards() if c.model_id == "wan-tiny")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[b.args.vae_dtype]
    latent = (3, 8, 12) if b.smoke else (21, 60, 104)
    with torch.device(b.device):
        vae = WanVAE(config)
    _randomise_(vae, 2)
    vae = vae.to(dtype).eval().requires_grad_(False)
    g = torch.Generator(device=b.device).manual_seed(4)
    z = torch.randn(1, config.z_dim, *latent, generator=g, device=b.device).to(dtype)
    out: dict[str, Any] = {"latent": "x".join(map(str, latent)), "dtype": b.args.vae_dtype}
    iters = 1 if b.smoke else 2
    with torch.no_grad():
        fv_video = vae.decode(z)
        out["fv"] = b.time_ms(lambda: vae.decode(z), warmup=0, iters=iters)
        try:
            from diffusers import AutoencoderKLWan
        except Exception as exc:  # noqa: BLE001
            out["diffusers"] = f"skipped: {type(exc).__name__}: {exc}"
        else:
            with torch.device(b.device):
                ref = AutoencoderKLWan(**config.to_diffusers_config())
            ref.load_state_dict(vae.state_dict(), strict=True)  # identical weights, every key
            ref = ref.to(dtype).eval()
            ref_video = ref.decode(z, return_dict=False)[0]
            out["diffusers"] = b.time_ms(lambda: ref.decode(z, return_dict=False), warmup=0, iters=iters)
            out["max_abs_diff_vs_diffusers"] = float((fv_video.float() - ref_video.float()).abs().max())
            out["time_ratio"] = round(out["fv"]["ms"] / out["diffusers"]["ms"], 3)
            if out["fv"]["peak_gib"] and out["diffusers"]["peak_gib"]:
                out["peak_ratio"] = round(out["fv"]["peak_gib"] / out["diffusers"]["peak_gib"], 3)
    return out


# --------------------------------------------------------------------------- report


def table(b: Bench) -> str:
    lines = ["| impl | batch | ms/step | x diffusers eager | TFLOP/s | x floor | peak GiB | compile/capture s | rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {r["batch"]: r["ms"] for r in b.rows if r["impl"] == "diffusers eager"}
    for r in b.rows:
        ratio = f"{r['ms'] / base[r['batch']]:.3f}" if r["batch"] in base else "-"
        build = r.get("compile_s", r.get("capture_s", "-"))
        err = r.get("rel_err_vs_eager", r.get("max_abs_diff_vs_fv", "-"))
        lines.append(f"| {r['impl']} | {r['batch']} | {r['ms']:.1f} | {ratio} | {r['achieved_tflops']} | "
                     f"{r.get('x_floor', '-')} | {r['peak_gib'] if r['peak_gib'] is not None else '-'} | {build} | {err} |")
    s = b.results["sections"]
    extra = ["", "| measure | result |", "|---|---|"]
    if "matmul" in s:
        extra.append(f"| {s['matmul']['n']}^3 matmul | {s['matmul']['tflops']} TFLOP/s |")
    batching = s.get("step_batching", {})
    for n, row in batching.items():
        if isinstance(row, dict) and "fused_ms" in row:
            extra.append(f"| {n} single-frame {batching['shape']} DiT steps fused vs one at a time | {row['fused_ms']} ms vs "
                         f"{row['one_at_a_time_ms']} ms = {row['throughput_x']}x throughput |")
    for impl, parts in s.get("step_parts", {}).items():
        if isinstance(parts, dict):
            extra.append(f"| one step's parts, {impl} ({parts['profiled']}) | attention {parts['attention_ms']} ms, matmul "
                         f"{parts['matmul_ms']} ms, other {parts['other_ms']} ms; busy {parts['busy_ms']} of {parts['wall_ms']} ms wall |")
    thr = s.get("engine_throughput", {})
    for key, value in thr.items():
        if key.endswith(":speedup"):
            n = key.split(":")[0]
            bat, one = thr[f"{n}:batched"], thr[f"{n}:one-at-a-time"]
            extra.append(f"| {n} concurrent single-frame requests | batched {bat['throughput_rps']} req/s vs one-at-a-time "
                         f"{one['throughput_rps']} req/s = {value}x; batches {bat['batches_by_size']} |")
    vae = s.get("vae", {})
    if isinstance(vae.get("fv"), dict):
        d = vae.get("diffusers")
        dtxt = f"diffusers {d['ms']:.0f} ms, {d['peak_gib']} GiB" if isinstance(d, dict) else str(d)
        extra.append(f"| VAE decode {vae['latent']} ({vae['dtype']}) | fv {vae['fv']['ms']:.0f} ms, {vae['fv']['peak_gib']} GiB; "
                     f"{dtxt}; time x{vae.get('time_ratio', '-')}, peak x{vae.get('peak_ratio', '-')} |")
    e2e = s.get("e2e", {})
    if "wall_s" in e2e:
        fused = e2e.get("fused")
        extra.append(f"| end to end {e2e['card']} {e2e['shape']}, {e2e['steps']} steps, {e2e['attention']} attention | "
                     f"eager {e2e['wall_s']} s (peak {e2e['peak_gib']} GiB)"
                     + (f"; fused tier {fused['wall_s']} s" if fused else "")
                     + (f"; graphs tier {e2e['graphs']['wall_s']} s" if e2e.get("graphs") else "")
                     + f"; device ms per op {e2e['op_device_ms']} |")
    overlap = s.get("overlap", {})
    if "wall_ratio_overlap_vs_one_lane" in overlap:
        one, two = (min(overlap[k], key=lambda r: r["wall_s"]) for k in ("one_lane", "overlap_lane"))
        extra.append(f"| {overlap['requests']} {overlap['card']} {overlap['shape']} requests arriving {overlap['arrival_interval_s']} s apart, one lane vs the "
                     f"VAE decode on a second lane | {one['wall_s']} s vs {two['wall_s']} s = "
                     f"x{overlap['wall_ratio_overlap_vs_one_lane']} ({two['overlapped_batches']} batches overlapped; "
                     f"peak {one['peak_gib']} vs {two['peak_gib']} GiB) |")
    runs = [v for v in [*thr.values(), e2e] if isinstance(v, dict) and v.get("scheduler_share_of_execute") is not None]
    for label, chosen in (("mean step >= 30 ms", [r for r in runs if r["mean_batch_ms"] >= 30]),
                          ("mean step < 30 ms", [r for r in runs if r["mean_batch_ms"] < 30])):
        if chosen:  # the bar (< 2%) is for steps of 30 ms or more
            shares = [r["scheduler_share_of_execute"] for r in chosen]
            host = [r["loop_host_share_of_execute"] for r in chosen]
            extra.append(f"| Engine scheduling overhead (scheduler_seconds / execute_seconds), runs with {label} | "
                         f"max {max(shares) * 100:.3f}% over {len(shares)} runs (mean steps "
                         f"{min(r['mean_batch_ms'] for r in chosen)}-{max(r['mean_batch_ms'] for r in chosen)} ms); "
                         f"the loops' own host code between steps (loop_host_seconds) max {max(host) * 100:.2f}% |")
    for name, data in s.items():
        if isinstance(data, dict) and "skipped" in data:
            extra.append(f"| {name} | {data['skipped']} |")
    for key, run in [*thr.items(), ("e2e", e2e)]:
        if isinstance(run, dict) and run.get("failed"):
            extra.append(f"| {key} | failed requests: {run['failed']} |")
    for name, error in b.results["errors"].items():
        extra.append(f"| {name} | not measured: {error[:160]} |")
    return "\n".join(lines + extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="folder for results.json, table.md and errors.log")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: checks every section's code path")
    parser.add_argument("--attention", default="sdpa_cudnn", help="attention driver for fv rows (default sdpa_cudnn)")
    parser.add_argument("--e2e-attention", default="vsa", help="the end-to-end fastwan request's DiT attention "
                        "(default vsa: the card's recipe; on CPU the smoke run stays dense)")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per denoise-step row")
    parser.add_argument("--budget-s", type=float, default=470.0, help="total wall budget; sections left out when it runs out")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vae-dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--diffusers-compile", action="store_true", help="also compile diffusers' model (about 2 minutes)")
    parser.add_argument("--skip", nargs="*", default=[], help="section names to leave out")
    parser.add_argument("--overlap-requests", type=int, default=4,
                        help="overlap section: fastwan requests submitted together")
    args = parser.parse_args(argv)
    b = Bench(args)
    log(f"fv GPU bench on {b.device} ({b.results['env'].get('gpu', 'cpu')}), budget {args.budget_s:.0f} s")
    sections: list[tuple[str, float, Callable[[], dict[str, Any] | None]]] = [
        ("matmul", 30, lambda: section_matmul(b)),
        ("dit", 90, lambda: section_dit(b)),
        ("diffusers", 200 if args.diffusers_compile else 60, lambda: section_diffusers(b)),
        ("graphs", 60, lambda: section_graphs(b)),
        ("step_parts", 60, lambda: section_step_parts(b)),
        ("vae", 60, lambda: section_vae(b)),
        ("step_batching", 60, lambda: section_step_batching(b)),
        ("engine_throughput", 100, lambda: section_engine_throughput(b)),
        ("e2e", 60, lambda: section_e2e(b)),
        ("overlap", 90, lambda: section_overlap(b)),
        ("compiled", 150, lambda: section_compiled(b)),
    ]
    for name, budget, fn in sections:
        if name in args.skip:
            b.results["errors"][name] = "skipped by --skip"
            continue
        if name in ("diffusers", "graphs", "step_parts", "compiled") and "dit" not in b.results["sections"]:
            b.results["errors"][name] = "skipped: the dit section failed"
            continue
        b.section(name, budget, fn)
    b.write()
    print(f"\nfv vs diffusers on {b.results['env'].get('gpu', b.device)} ({b.results['env']['date']}); "
          f"full results in {args.output / 'results.json'}\n")
    print(b.results["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
