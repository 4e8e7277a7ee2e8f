"""Cosmos 3 benchmark: fv against diffusers' ``Cosmos3OmniTransformer`` on the same weights, in one run.

    python bench/bench_cosmos3.py out.json                    # cosmos3-nano, random weights built on the GPU, bf16
    python bench/bench_cosmos3.py out.json --card cosmos3-tiny --device cpu   # the tiny card on the CPU
    python bench/bench_cosmos3.py out.json --smoke            # tiny, CPU, one repeat, small counts (CI)

One resident instance of the card is built with random weights on the device (no checkpoint;
the byte tokenizer stands in for Qwen's: its ids are a subset of the real vocabulary, so the
model's cost is the real one). diffusers' transformer is built beside it holding the *same*
weight tensors (``load_state_dict(assign=True)``: no second copy of a real-size model).

1. ``step``: one denoise step (cond + uncond) at the card's default size. fv: the instance's
   ``generate`` op against the prompt K/V computed once per request. fv recomputing the text
   K/V every step (the text tower's cost inside each step, as diffusers pays it). diffusers:
   the transformer called as ``Cosmos3OmniPipeline`` calls it (one forward per branch over the
   packed text + video sequence). Also the text K/V itself, and how far fv's velocity is from
   diffusers' (same weights, same inputs).
2. ``omni``: one request with prompt upsampling (the reasoner decodes the rewrite, then T2V
   on the same instance) through the Engine: wall time and device time per op.
3. ``concurrent``: ``--concurrent`` omni requests submitted together with step batching
   (``batching="throughput"``) against the same requests one at a time; and the same for plain
   T2V requests of one prompt length, whose generator steps fuse across requests.
4. ``decode``: the reasoner's decode on the eager and the CUDA-graphed tier of the same instance:
   tok/s of 8 chat requests one at a time (batch 1) and batched (batch 8), one prompt
   upsampling's decode of ``--upsample-tokens`` (512) tokens with the upsampling sampler, and
   the physical bound at batch 1 (reasoner weight bytes per token at the measured bandwidth).

Sections 3 and 4 report the rows each call of an op really held (``call_rows``; the graphed tier's
``replayed_rows_bucket``): the executor fuses a scheduled batch only where the card declares
``parity.batched_vs_alone`` at the instance's precision, and cosmos3-nano/super declare none, so
their "batched" runs make one call per request. For such a card each batched run is repeated
under a copy of the card that declares one (``batch8_fused``, ``batched_fused``: a measurement,
not a deployable card), with how far fusing moved the results from the same requests alone
(frames' max abs, texts kept, one token step's logits fused vs each row alone): the figures a
real declaration needs.
5. ``memory``: weights of one instance serving text and video vs two engines (counted on the
   meta device for Nano and Super); with ``--card cosmos3-tiny`` also the peak RSS of a process doing both.

Without CUDA a real-size card's sections 1-4 are reported as skipped (exit 0). Prints a
markdown table and writes every number as JSON to the given path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from collections import Counter
from typing import Any, Callable, Iterator

import torch

from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.diffusers_reference import diffusers_forward_kwargs, diffusers_transformer
from fv_cosmos3.decode_kernels import DecodeKernels
from fv_cosmos3.graphed_decode import GraphedDecode
from fv_cosmos3.instance import Cosmos3Instance, cosmos3_ops, text_pool_config
from fv_cosmos3.loops import upsample_params
from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT
from fv_cosmos3.models.audio_vae import Cosmos3AudioDecoder, Cosmos3AudioDecoderConfig
from fv_cosmos3.models.layers import MRoPE
from fv_cosmos3.models.state_dict import is_reasoner_key
from fv_cosmos3.models.tokenizer import ByteTokenizer, PromptSpec, build_generation_prompt
from fv_kernel.api import (
    ARParams, DiffusionParams, Engine, InstanceOptions, ModelCard, PagedKVPool, Request, SchedulerConfig,
    TaskType, TextPart, torch_dtype,
)
from fv_kernel.runtime.engine import run_concurrently, run_serially
from fv_wan.models.vae import WanVAE, WanVAEConfig
from bench_batched_vs_alone import measuring as declaring_unbounded  # bench/, beside this script
from op_times import OpTimes  # bench/, beside this script
from random_weights import seeded_manifest

PROMPT = "a red fox runs through deep snow at dawn, low sun, long shadows"
TIMESTEP = 937.5


class Bench:
    """The run's settings, resolved once from the command line."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke: bool = args.smoke
        self.card_id: str = "cosmos3-tiny" if args.smoke else args.card
        wanted = "cpu" if args.smoke else (args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.device = torch.device(wanted)
        self.cuda = self.device.type == "cuda"
        self.precision = "fp32" if self.card_id == "cosmos3-tiny" else "bf16"
        self.dtype = torch_dtype(self.precision)
        self.repeats: int = 1 if args.smoke else args.repeats
        self.concurrent: int = 2 if args.smoke else args.concurrent
        self.decode_tokens: int = 4 if args.smoke else getattr(args, "decode_tokens", 64)
        self.args = args

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_ms(self, fn: Callable[[], Any]) -> float:
        """Median wall ms of ``repeats`` calls after one warm-up, the device synchronised around each."""
        fn()
        times = []
        for _ in range(self.repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    def peak_gib(self, fn: Callable[[], Any]) -> float | None:
        """Peak device memory above what was allocated before one call (CUDA only)."""
        if not self.cuda:
            return None
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        fn()
        self.sync()
        return (torch.cuda.max_memory_allocated(self.device) - base) / 2**30


# --------------------------------------------------------------------------- the instance (random weights on the device)


def _randomise_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter redrawn on its own device: N(0, 1/fan_in) for matrices, norm gains near 1, small vectors."""
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
            if p.dim() > 1:
                p.copy_(noise * p[0].numel() ** -0.5)
            elif "norm" in name:
                p.copy_(1 + 0.02 * noise)
            else:
                p.copy_(0.02 * noise)


def random_instance(b: Bench, card: ModelCard) -> Cosmos3Instance:
    """The card made resident with random weights built on the device, in the card's precision policy,
    with the plugin's own ops and text-KV pool."""
    options = InstanceOptions(device=str(b.device), precision=b.precision)
    config = Cosmos3Config(**card.components["transformer"].config)
    card = seeded_manifest(card)  # what ``load`` below does: no checkpoint for preflight to look for

    def load(component_id: str) -> Any:
        spec = card.components[component_id]
        if spec.kind == "tokenizer":
            return ByteTokenizer(vocab_size=config.vocab_size)
        builders: dict[str, Callable[[], torch.nn.Module]] = {
            "transformer": lambda: Cosmos3MoT(config),
            "vae": lambda: WanVAE(WanVAEConfig(**spec.config)),
            "sound_decoder": lambda: Cosmos3AudioDecoder(Cosmos3AudioDecoderConfig(**spec.config)),
        }
        previous = torch.get_default_dtype()
        torch.set_default_dtype(b.dtype)  # built in the final dtype: no fp32 copy of a 16B model
        try:
            with torch.device(b.device):
                module = builders[component_id]()
        finally:
            torch.set_default_dtype(previous)
        for name in spec.precision_policy.keep_fp32_modules:
            getattr(module, name).float()
        _randomise_(module, seed=len(component_id))
        if isinstance(module, Cosmos3MoT):  # RoPE tables in fp32, as the card's loader rebuilds them
            module.rotary_emb = MRoPE(config.head_dim, config.rope_theta, config.rope_axes_dim).to(b.device)
        return module.eval().requires_grad_(False)

    return Cosmos3Instance(card=card, options=options, component_loader=load, ops_builder=cosmos3_ops,
                           weights_version="random-on-device", text_kv_pool=PagedKVPool(text_pool_config(card, options)))


def _latent_shape(card: ModelCard, height: int, width: int, frames: int) -> tuple[int, int, int, int, int]:
    vae = WanVAEConfig(**card.components["vae"].config)
    config = Cosmos3Config(**card.components["transformer"].config)
    return (1, config.latent_channel, (frames - 1) // vae.temporal_compression + 1, height // vae.spatial_compression,
            width // vae.spatial_compression)


# --------------------------------------------------------------------------- 1. the denoise step, fv vs diffusers


def bench_step(b: Bench, instance: Cosmos3Instance) -> dict[str, Any]:
    card = instance.card
    d = card.capabilities.defaults
    assert d is not None and d.height and d.width and d.frames and d.fps
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    mot: Cosmos3MoT = instance.component("transformer")
    tokenizer = instance.component("tokenizer")
    spec = PromptSpec(num_frames=d.frames, height=d.height, width=d.width, fps=d.fps)
    ids = {"cond": build_generation_prompt(PROMPT, tokenizer, spec),
           "uncond": build_generation_prompt("", tokenizer, spec, negative=True)}
    shape = _latent_shape(card, d.height, d.width, d.frames)
    video = torch.randn(shape, generator=torch.Generator(device=b.device).manual_seed(1), device=b.device)
    text_kv_op, generate_op = instance.op("text_kv").fn, instance.op("generate").fn
    params = {"branches": ("cond", "uncond"), "fps": d.fps, "video_noisy": tuple(range(shape[2]))}

    def text_kv() -> dict[str, torch.Tensor]:
        inputs: dict[str, torch.Tensor] = {}
        for branch, branch_ids in ids.items():
            out = text_kv_op({"ids": torch.tensor([branch_ids], device=b.device)}, {})
            inputs[f"k_{branch}"], inputs[f"v_{branch}"] = out["keys"], out["values"]
        return inputs

    with torch.inference_mode():
        cached = {"video": video, "timestep": torch.tensor([TIMESTEP], device=b.device), **text_kv()}
        fv_out = generate_op(cached, params)["v_video"][0]  # (branches, C, T, H, W)
        out: dict[str, Any] = {
            "height": d.height, "width": d.width, "frames": d.frames, "latent_shape": list(shape),
            "video_tokens": shape[2] * (shape[3] // mot.config.latent_patch_size) * (shape[4] // mot.config.latent_patch_size),
            "text_tokens": {k: len(v) for k, v in ids.items()}, "precision": b.precision,
            "fv_step_ms": b.time_ms(lambda: generate_op(cached, params)),
            "fv_step_text_recomputed_ms": b.time_ms(lambda: generate_op({**cached, **text_kv()}, params)),
            "text_kv_once_ms": b.time_ms(text_kv),
            "fv_step_peak_gib": b.peak_gib(lambda: generate_op(cached, params)),
        }
        twin = diffusers_transformer(mot.config, mot.state_dict(), device=b.device, dtype=b.dtype, share=True)
        shared = all(p.data_ptr() == q.data_ptr() for p, q in zip(twin.state_dict().values(), mot.state_dict().values()))
        kwargs = {branch: diffusers_forward_kwargs(twin, mot.config, branch_ids, video.to(b.dtype), timestep=TIMESTEP,
                                                   fps=d.fps, video_condition_frames=[])
                  for branch, branch_ids in ids.items()}

        def diffusers_step() -> list[torch.Tensor]:
            # The pipeline's two forwards; each returns per-item lists, the video item being (1, C, T, H, W).
            return [twin(**kwargs[branch])[0][0][0] for branch in ("cond", "uncond")]

        reference = torch.stack(diffusers_step()).float()
        assert reference.shape == fv_out.shape, (tuple(reference.shape), tuple(fv_out.shape))
        out.update({
            "diffusers_weights_shared": shared,
            "diffusers_step_ms": b.time_ms(diffusers_step),
            "diffusers_step_peak_gib": b.peak_gib(diffusers_step),
            "fv_vs_diffusers_max_abs": (fv_out.float() - reference).abs().max().item(),
            "velocity_max_abs": reference.abs().max().item(),
        })
        del twin
    out["fv_vs_diffusers"] = out["fv_step_ms"] / out["diffusers_step_ms"]
    out["text_kv_reuse_speedup"] = out["fv_step_text_recomputed_ms"] / out["fv_step_ms"]
    return out


# --------------------------------------------------------------------------- 2-4. requests through the Engine


def _engine_run(b: Bench, instance: Cosmos3Instance, requests: list[Request], *, batched: bool,
                device_thread: bool | None = None) -> dict[str, Any]:
    # Under --profile the ops run on the event loop's thread: the profiler records only the threads it saw start.
    thread = b.args.profile is None if device_thread is None else device_thread
    config = (SchedulerConfig(batching="throughput", max_queue=4096, device_thread=thread) if batched
              else SchedulerConfig(scheduling="request", max_queue=4096, device_thread=thread))
    times = OpTimes()
    engine = Engine(config, observers=[times])
    engine.add_instance(instance)
    b.sync()
    start = time.perf_counter()
    results = (run_concurrently if batched else run_serially)(engine, requests)
    b.sync()
    seconds = time.perf_counter() - start
    failed = [(r.request_id, r.error) for r in results if r.status != "completed"]
    if failed:
        raise RuntimeError(f"requests failed: {failed}")
    texts = [a for r in results for a in r.artifacts if a.kind == "text"]
    return {
        "seconds": seconds, "requests": len(requests), "requests_per_s": len(requests) / seconds,
        "op_seconds": dict(times.seconds), "largest_batch": dict(times.largest),
        "batch_sizes": {op: dict(sizes) for op, sizes in times.batch_sizes.items()},
        # Rows per call of each op: a scheduled batch runs as one call only where the executor fuses it.
        "call_rows": {op: dict(rows) for op, rows in times.call_rows.items()},
        "text_tokens": [len(a.token_ids) for a in texts],  # upsampled prompts, or chat answers
        # Per request, in order (read by the sections that compare runs; not written to the JSON): its text's
        # token ids (None without a text artifact) and its artifacts.
        "_token_ids": [next((list(a.token_ids) for a in r.artifacts if a.kind == "text"), None) for r in results],
        "_artifacts": [r.artifacts for r in results],
    }


def _declares_batching(instance: Cosmos3Instance) -> bool:
    """Whether the card promises how far fusing moves a result at the instance's precision: without it the
    executor runs a scheduled batch's rows one by one (``parity.batched_vs_alone``; cosmos3-nano/super declare
    none yet), so a "batched" run is one call per row."""
    return instance.card.parity.batching_tolerance(instance.precision) is not None


@contextlib.contextmanager
def _batching_declared(instance: Cosmos3Instance) -> Iterator[None]:
    """The instance's card, for the body, declaring an unbounded ``batched_vs_alone`` at the instance's precision
    (``bench_batched_vs_alone.measuring``): the executor fuses its steps, and the run measures what a real
    declaration would give and how far it moves results. Never a card to deploy."""
    card = instance.card
    instance.card = declaring_unbounded(card, instance.precision)
    try:
        yield
    finally:
        instance.card = card


def _artifacts_max_abs(left: list[list[Any]], right: list[list[Any]]) -> float:
    """The largest absolute difference between two runs' tensor artifacts (frames, samples), request by request."""
    worst = 0.0
    for a_list, b_list in zip(left, right):
        for a, b in zip(a_list, b_list):
            for name in ("frames", "samples", "tensor"):
                x, y = getattr(a, name, None), getattr(b, name, None)
                if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and x.numel():
                    worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


def _same_texts(left: list[list[int] | None], right: list[list[int] | None]) -> int | None:
    """How many requests returned the same text tokens in both runs (None: the requests return no text)."""
    pairs = [(x, y) for x, y in zip(left, right) if x is not None or y is not None]
    return sum(x == y for x, y in pairs) if pairs else None


def _public(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def _t2v(b: Bench, instance: Cosmos3Instance, prefix: str, n: int, *, upsample: bool, height: int, width: int,
         frames: int, steps: int) -> list[Request]:
    # One prompt length for the plain requests (byte tokenizer: equal character counts), so their steps share a shape.
    subjects = ["a red fox", "a grey owl", "a tall tree", "a blue boat", "an old bell", "a white cat", "a long road",
                "a dark cave"]
    requests = [Request(request_id=f"{prefix}{i}", model=b.card_id, task=TaskType.TEXT_TO_VIDEO,
                        inputs=(TextPart(text=f"{subjects[i % len(subjects)]:<12}in the snow at dawn"),),
                        prompt_upsampling=upsample,
                        diffusion=DiffusionParams(height=height, width=width, frames=frames, steps=steps, seed=i))
                for i in range(n)]
    tokens = b.args.upsample_tokens
    if not (upsample and tokens):
        return requests
    # The loop's own upsampling sampler, with a shorter rewrite.
    return [r.model_copy(update={"ar": upsample_params(r, instance).model_copy(update={"max_tokens": tokens})})
            for r in requests]


def _omni_size(b: Bench, card: ModelCard) -> dict[str, int]:
    d = card.capabilities.defaults
    assert d is not None and d.height and d.width and d.frames and d.steps
    a = b.args
    return {"height": a.omni_height or d.height, "width": a.omni_width or d.width,
            "frames": a.omni_frames or (d.frames if card.model_id == "cosmos3-tiny" else 29),
            "steps": a.omni_steps or d.steps}


def bench_omni(b: Bench, instance: Cosmos3Instance) -> dict[str, Any]:
    size = _omni_size(b, instance.card)
    _engine_run(b, instance, _t2v(b, instance, "warm-omni-", 1, upsample=True, **{**size, "steps": 1}), batched=False)
    run = _engine_run(b, instance, _t2v(b, instance, "omni-", 1, upsample=True, **size), batched=False)
    return {**size, **_public(run)}


def bench_concurrent(b: Bench, instance: Cosmos3Instance) -> dict[str, Any]:
    size = _omni_size(b, instance.card)
    n = b.concurrent
    declared = _declares_batching(instance)
    out: dict[str, Any] = {**size, "requests": n, "batching_declared": declared}
    for name, upsample in (("omni", True), ("t2v_one_prompt_length", False)):
        serial = _engine_run(b, instance, _t2v(b, instance, f"s-{name}-", n, upsample=upsample, **size), batched=False)
        runs = {"batched": _engine_run(b, instance, _t2v(b, instance, f"b-{name}-", n, upsample=upsample, **size),
                                       batched=True)}
        if not declared:  # "batched" ran each request's rows alone; this is what a declaration would give
            with _batching_declared(instance):
                runs["batched_fused"] = _engine_run(b, instance, _t2v(b, instance, f"f-{name}-", n, upsample=upsample,
                                                                      **size), batched=True)
        entry: dict[str, Any] = {"one_at_a_time": _public(serial)}
        for key, run in runs.items():
            entry[key] = {
                **_public(run), "speedup": run["requests_per_s"] / serial["requests_per_s"],
                # The same requests (prompts, seeds) as one at a time: what batching moved (the measurement a
                # card's parity.batched_vs_alone declares: frames in [0, 1]; omni videos differ wholesale once
                # an upsampled prompt does), and how many requests' texts stayed identical.
                "vs_alone_max_abs": _artifacts_max_abs(serial["_artifacts"], run["_artifacts"]),
                "same_text_as_alone": _same_texts(serial["_token_ids"], run["_token_ids"]),
            }
        entry["speedup"] = entry["batched"]["speedup"]
        out[name] = entry
    return out


def _hbm_bytes_per_s(b: Bench) -> float:
    """Measured device memory bandwidth: a 2 GiB device-to-device copy (read + write), best of three."""
    src = torch.empty(2**30, dtype=torch.uint8, device=b.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        b.sync()
        start = time.perf_counter()
        dst.copy_(src)
        b.sync()
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * 2**30 / best


def bench_decode(b: Bench, instance: Cosmos3Instance) -> dict[str, Any]:
    """Reasoner decode on the eager tier and the CUDA-graphed tier (``fv_cosmos3.graphed_decode``) of one
    instance: 8 chat requests one at a time (batch 1) and batched (batch 8), and one prompt upsampling's
    decode of ``--upsample-tokens`` (512) tokens with the upsampling sampler; beside them the physical bound
    at batch 1, the reasoner's weight bytes read once per token at the measured memory bandwidth."""
    prompts = ["a fox", "a boat drifting on a calm lake", "snow", "city lights at night in the rain", "a dog",
               "waves", "a bird over a field of wheat", "a slow train"]

    def requests(prefix: str, tokens: int) -> list[Request]:
        return [Request(request_id=f"{prefix}{i}", model=b.card_id, task=TaskType.TEXT_GENERATION,
                        inputs=(TextPart(text=prompts[i]),),
                        ar=ARParams(max_tokens=tokens, temperature=0.8, top_k=20, seed=i, stop_token_ids=()))
                for i in range(len(prompts))]

    upsample_tokens = b.args.upsample_tokens or (8 if b.smoke else 512)

    def upsampling(prefix: str) -> list[Request]:
        # The upsampling loop's sampler and budget (T 0.7, top-p 0.8, top-k 20, presence 1.5) on a chat request.
        return [Request(request_id=f"{prefix}up", model=b.card_id, task=TaskType.TEXT_GENERATION,
                        inputs=(TextPart(text=PROMPT),),
                        ar=ARParams(max_tokens=upsample_tokens, temperature=0.7, top_p=0.8, top_k=20,
                                    presence_penalty=1.5, seed=0, stop_token_ids=()))]

    config = Cosmos3Config(**instance.card.components["transformer"].config)
    weights = _weight_bytes(config, b.dtype)
    embed = config.vocab_size * config.hidden_size * torch.empty((), dtype=b.dtype).element_size()
    per_token = weights["reasoner_only"] - embed  # every reasoner matrix once, and one embedding row (negligible)
    out: dict[str, Any] = {"requests": len(prompts), "max_tokens": b.decode_tokens,
                           "reasoner_bytes_per_token": per_token}
    if b.cuda:
        bandwidth = _hbm_bytes_per_s(b)
        out["measured_hbm_bytes_per_s"] = bandwidth
        out["bound_tokens_per_s_batch1"] = bandwidth / per_token
    buckets = instance.options.compute.graph_batch_buckets if instance.options.compute else (1, 2, 4, 8, 16, 32)
    # The graphed tier once per chain length (``compute.decode_tokens_per_step``): "graphed" schedules every token,
    # "graphed_xN" runs N tokens per scheduled step.
    # "+triton": the same with the Triton decode kernels in the captured step (compute.fused_ops: triton).
    chains = getattr(b.args, "decode_tokens_per_step", None) or [1]
    kernel_modes = getattr(b.args, "decode_kernels", None) or ["off"]
    tiers = [("eager", None, 1)] + ([
        ((f"graphed_x{n}" if n > 1 else "graphed") + ("+triton" if mode == "triton" else ""),
         GraphedDecode(tuple(buckets), kernels=DecodeKernels() if mode == "triton" else None), n)
        for mode in kernel_modes for n in chains] if b.cuda or b.smoke else [])
    wanted = getattr(b.args, "decode_tiers", ("eager", "graphed"))
    tiers = [tier for tier in tiers if tier[0].split("+")[0].split("_x")[0] in wanted]
    out["tiers"] = [name for name, _, _ in tiers]
    # Without a declaration at the instance's precision (cosmos3-nano/super in bf16) "batch8" runs each request's
    # token step alone, one call per row; "batch8_fused" is the same run under a declaring copy of the card.
    declared = _declares_batching(instance)
    out["batching_declared"] = declared
    runs = [("batch8", True, False), ("batch1", False, False)] + ([] if declared else [("batch8_fused", True, True)])
    split_done: set[bool] = set()  # kernels on/off: the step is the same graph in every chain length
    for tier, graphed, chain in tiers:
        if graphed is not None and not b.cuda:
            graphed.capture = False  # --smoke on the CPU: the static step, run eagerly
        instance.graphed_decode = graphed
        instance.decode_tokens_per_step = chain
        # Warm-up (captures every graph the timed runs replay: batch buckets 1 and 8, their context buckets).
        with contextlib.nullcontext() if declared else _batching_declared(instance):
            _engine_run(b, instance, requests(f"warm-{tier}-", min(b.decode_tokens, 4)), batched=True)
        _engine_run(b, instance, requests(f"warm1-{tier}-", min(b.decode_tokens, 4))[:1], batched=False)
        if graphed is not None:
            _engine_run(b, instance, upsampling(f"warm-{tier}-"), batched=False)
        result: dict[str, Any] = {}
        tokens: dict[str, list[list[int] | None]] = {}
        for name, batched, measuring in runs:
            before = (Counter(graphed.replayed_shapes), graphed.captures) if graphed is not None else None
            with _batching_declared(instance) if measuring else contextlib.nullcontext():
                run = _engine_run(b, instance, requests(f"{tier}-{name}-", b.decode_tokens), batched=batched)
            tokens[name] = run["_token_ids"]
            result[name] = {**_public(run), "tokens_per_s": sum(run["text_tokens"]) / run["seconds"]}
            if graphed is not None and before is not None:
                # What each replay held: "rows/bucket" -> replays (8 rows in bucket 8 when fused; 1/1 when not).
                shapes = graphed.replayed_shapes - before[0]
                result[name]["replayed_rows_bucket"] = {f"{r}/{k}": n for (r, k), n in sorted(shapes.items())}
                result[name]["captures"] = graphed.captures - before[1]
        for name, batched, _ in runs:
            if batched:  # the same prompts and seeds as batch1: rows that ran alone keep every text as it was
                result[name]["same_text_as_batch1"] = _same_texts(tokens[name], tokens["batch1"])
        if getattr(b.args, "host_profile", False) and graphed is not None:
            result["host_profile"] = _host_profile(b, instance, requests(f"{tier}-host-", b.decode_tokens), tier)
        up = _engine_run(b, instance, upsampling(f"{tier}-"), batched=False)
        result["upsample"] = {"tokens": up["text_tokens"][0], "seconds": up["seconds"]}
        if graphed is not None:
            result["captures"], result["replays"], result["eager_steps"] = graphed.captures, graphed.replays, graphed.eager_steps
        result["one_step_fused_vs_alone"] = _step_fused_vs_alone(instance, prompts)
        if graphed is not None and (graphed.kernels is not None) not in split_done:
            split_done.add(graphed.kernels is not None)
            with torch.inference_mode():  # as the Engine's steps run (the pool's storage is an inference tensor)
                result["step_split"] = _step_split(b, graphed, result["batch1"]["tokens_per_s"], replays=3 if b.smoke else 50)
        result["tokens_per_step"] = chain
        out[tier] = result
    instance.graphed_decode = None
    instance.decode_tokens_per_step = 1
    if "graphed" in out and "eager" in out:
        for name, _, _ in runs:
            if name != "batch1":
                out[f"graphed_vs_eager_{name}"] = (out["graphed"][name]["tokens_per_s"]
                                                   / out["eager"][name]["tokens_per_s"])
        out["graphed_vs_eager_batch1"] = out["graphed"]["batch1"]["tokens_per_s"] / out["eager"]["batch1"]["tokens_per_s"]
    return out


def _host_profile(b: Bench, instance: Cosmos3Instance, requests: list[Request], tier: str) -> dict[str, Any]:
    """The batch-8 run again under cProfile, its ops on the event loop's thread (no device thread, so one profile
    sees the loops, the scheduler and the ops' host side): the run's seconds and op seconds, and the functions by
    own time, written in full beside the JSON as ``decode_host_<tier>.txt`` (issue 36 section 3: where the host's
    share of a decode goes)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    with contextlib.nullcontext() if _declares_batching(instance) else _batching_declared(instance):
        profiler.enable()
        run = _engine_run(b, instance, requests, batched=True, device_thread=False)
        profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    Path(b.args.output).with_name(f"decode_host_{tier.replace('+', '_')}.txt").write_text(text.getvalue())
    return {"seconds": run["seconds"], "op_seconds": run["op_seconds"], "tokens": sum(run["text_tokens"])}


def _step_split(b: Bench, graphed: GraphedDecode, tokens_per_s: float, replays: int = 50) -> dict[str, Any]:
    """Where a batch-1 token's time goes: each batch-1 capture replayed back to back on its static buffers (the
    step's own device time; nothing else runs) beside the Engine's wall time per token in the batch-1 run; the
    difference is the host's (the loop, the scheduler, filling the static buffers, waiting on the token). On CUDA the
    same static step is also run kernel by kernel under torch.profiler: ``kernels`` lists where its device time goes
    (written in full beside the JSON as ``decode_kernels.txt``)."""
    split: dict[str, Any] = {"engine_ms_per_token_batch1": 1000 / tokens_per_s, "replay_ms": {}}
    keys = sorted((k for k in graphed.keys() if k.bucket == 1), key=lambda k: (k.context, k.sampling))
    for key in keys:
        graphed.replay(key)
        b.sync()
        start = time.perf_counter()
        for _ in range(replays):
            graphed.replay(key)
        b.sync()
        split["replay_ms"][f"context {key.context}{', sampling' if key.sampling else ''}"] = (
            1000 * (time.perf_counter() - start) / replays)
    if b.cuda and keys:
        from torch.profiler import ProfilerActivity, profile

        key = keys[0]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graphed.replay(key, captured=False)
            b.sync()
        averages = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in averages) / 3
        split["eager_static_step_device_ms"] = total / 1000
        split["kernels"] = [{"name": e.key[:80], "ms_per_step": e.self_device_time_total / 3000,
                             "calls_per_step": e.count / 3} for e in averages[:15]]
        name = "decode_kernels_triton.txt" if graphed.kernels is not None else "decode_kernels.txt"
        Path(b.args.output).with_name(name).write_text(
            prof.key_averages().table(sort_by="self_device_time_total", row_limit=60) + "\n")
    return split


def _step_fused_vs_alone(instance: Cosmos3Instance, prompts: list[str]) -> dict[str, Any]:
    """One ``ar_token`` step of the prompts' sequences as one fused call against each row alone, through the
    instance's op on its current tier: how far fusing moves a row's logits (what a batching declaration must
    cover), and in how many rows the greedy token stayed the same."""
    pool = instance.text_kv_pool
    assert pool is not None
    tokenizer = instance.component("tokenizer")
    prefill, step = instance.op("ar_prefill"), instance.op("ar_token")
    tables, plans = [], []
    try:
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                ids = tokenizer.chat_ids([{"role": "user", "content": prompt}])
                table = pool.allocate(f"bench-one-step-{i}", tokens=len(ids) + 1)
                tables.append(table)
                table_ids = pool.table_tensor(table).unsqueeze(0)
                logits = prefill.fn({"ids": torch.tensor([ids]), "table": table_ids}, {})["logits"]
                plans.append({"token": logits.argmax(-1).view(1, 1).cpu(), "table": table_ids,
                              "length": torch.tensor([len(ids)])})
            # Each row rewrites its own new-token slot: the alone steps first, then the fused one.
            alone = torch.cat([step.fn(plan, {})["logits"] for plan in plans]).float()
            fused = torch.cat([out["logits"] for out in step.run_fused(plans, {})]).float()
    finally:
        for table in tables:
            pool.free(table)
    return {"rows": len(plans), "logits_max_abs": float((fused - alone).abs().max()),
            "logits_abs_max": float(alone.abs().max()), "bit_identical": bool(torch.equal(fused, alone)),
            "same_greedy_token_rows": int((fused.argmax(-1) == alone.argmax(-1)).sum())}


# --------------------------------------------------------------------------- 5. memory (counted; RSS on the CPU)


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


def bench_memory(b: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, config, dtype in (("tiny_fp32", Cosmos3Config.tiny(), torch.float32),
                                ("nano_bf16", Cosmos3Config.nano(), torch.bfloat16),
                                ("super_bf16", Cosmos3Config.super_(), torch.bfloat16)):
        out[name] = _weight_bytes(config, dtype)
    if b.card_id == "cosmos3-tiny" and not b.smoke:
        for mode in ("one", "two"):
            rss = subprocess.run([sys.executable, "-c", _RSS_CHILD, mode], capture_output=True, text=True, check=True)
            out[f"tiny_peak_rss_kib_{mode}"] = int(rss.stdout.strip().splitlines()[-1])
    return out


# --------------------------------------------------------------------------- report


def _rows(results: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    step = results.get("step")
    if step:
        rows += [
            (f"denoise step cond+uncond at {step['height']}x{step['width']}x{step['frames']} "
             f"({step['video_tokens']} video tokens), fv, text K/V once per request (ms)", f"{step['fv_step_ms']:.1f}"),
            ("same step, diffusers Cosmos3OmniTransformer, same weights (ms)", f"{step['diffusers_step_ms']:.1f}"),
            ("  fv / diffusers", f"{step['fv_vs_diffusers']:.2f}x"),
            ("same step, fv recomputing the text K/V every step (ms)", f"{step['fv_step_text_recomputed_ms']:.1f}"),
            ("  text K/V once vs every step", f"{step['text_kv_reuse_speedup']:.2f}x"),
            ("text K/V of both prompts, once per request (ms)", f"{step['text_kv_once_ms']:.1f}"),
            ("fv vs diffusers velocity, max abs (of max |v|)",
             f"{step['fv_vs_diffusers_max_abs']:.2e} (of {step['velocity_max_abs']:.2f})"),
        ]
        if step["fv_step_peak_gib"] is not None:
            rows.append(("step peak above weights, fv / diffusers (GiB)",
                         f"{step['fv_step_peak_gib']:.2f} / {step['diffusers_step_peak_gib']:.2f}"))
    omni = results.get("omni")
    if omni:
        ops = ", ".join(f"{k} {v:.2f}" for k, v in sorted(omni["op_seconds"].items()))
        rows.append((f"one omni request (upsample {omni['text_tokens'][0]} tokens, then "
                     f"{omni['height']}x{omni['width']}x{omni['frames']}, {omni['steps']} steps), end to end (s)",
                     f"{omni['seconds']:.2f} (op seconds: {ops})"))
    conc = results.get("concurrent")
    if conc:
        for name in ("omni", "t2v_one_prompt_length"):
            c = conc[name]
            for key in ("batched", "batched_fused"):
                if key not in c:
                    continue
                run = c[key]
                label = "batched" if key == "batched" else "batched under a declaring card (measurement)"
                rows.append((f"{conc['requests']} concurrent {name.replace('_', ' ')} requests: {label} / one at a "
                             "time (s)",
                             f"{run['seconds']:.2f} / {c['one_at_a_time']['seconds']:.2f} = {run['speedup']:.2f}x "
                             f"(generate calls by rows {_calls(run, 'generate')}; vs alone: max abs "
                             f"{run['vs_alone_max_abs']:.2g}" + (f", same text {run['same_text_as_alone']}/{conc['requests']}"
                                                               if run["same_text_as_alone"] is not None else "") + ")"))
    dec = results.get("decode")
    if dec:
        if not dec["batching_declared"]:
            rows.append(("decode: the card declares no parity.batched_vs_alone at this precision, so batch 8 runs "
                         "each request's token step alone; batch 8 fused: the same under a declaring copy", ""))
        for tier in dec.get("tiers", ("eager", "graphed")):
            if tier not in dec:
                continue
            t = dec[tier]
            per_step = t.get("tokens_per_step", 1)
            tier = f"{tier} ({per_step} tokens per scheduled step)" if per_step > 1 else tier
            rows.append((f"reasoner decode, {tier}: batch 1 / batch 8 ({dec['requests']} chat requests) (tok/s)",
                         f"{t['batch1']['tokens_per_s']:.1f} / {t['batch8']['tokens_per_s']:.1f} "
                         f"(batch 8's ar_token calls by rows {_calls(t['batch8'], 'ar_token')})"))
            split = []
            for name in ("batch1", "batch8"):
                ops = t[name]["op_seconds"]
                prefill, token = ops.get("ar_prefill", 0.0), ops.get("ar_token", 0.0)
                split.append(f"{name}: prefill {prefill:.2f}, token steps {token:.2f}, "
                             f"the rest {t[name]['seconds'] - prefill - token:.2f} of {t[name]['seconds']:.2f}")
            rows.append((f"reasoner decode, {tier}: where the wall time went (s)", "; ".join(split)))
            if "batch8_fused" in t:
                f = t["batch8_fused"]
                rows.append((f"reasoner decode, {tier}: batch 8 fused (tok/s)",
                             f"{f['tokens_per_s']:.1f} (ar_token calls by rows {_calls(f, 'ar_token')}; same text as "
                             f"batch 1 {f['same_text_as_batch1']}/{dec['requests']})"))
            one = t["one_step_fused_vs_alone"]
            rows += [
                (f"one {tier} token step of {one['rows']} rows fused vs each alone: logits max abs (of max |logit|), "
                 "same greedy token", f"{one['logits_max_abs']:.2g} (of {one['logits_abs_max']:.3g}), "
                 f"{one['same_greedy_token_rows']}/{one['rows']}"),
                (f"prompt upsampling decode, {tier}: {t['upsample']['tokens']} tokens (s)", f"{t['upsample']['seconds']:.2f}"),
            ]
        if "graphed_vs_eager_batch1" in dec:
            fused = (f" / {dec['graphed_vs_eager_batch8_fused']:.2f}x" if "graphed_vs_eager_batch8_fused" in dec else "")
            rows.append(("  graphed / eager, batch 1 / batch 8" + (" / batch 8 fused" if fused else ""),
                         f"{dec['graphed_vs_eager_batch1']:.2f}x / {dec['graphed_vs_eager_batch8']:.2f}x{fused}"))
        if "bound_tokens_per_s_batch1" in dec:
            for tier in dec.get("tiers", ()):
                split = dec.get(tier, {}).get("step_split")
                if split and split["replay_ms"]:
                    replays = ", ".join(f"{name} {ms:.2f}" for name, ms in split["replay_ms"].items())
                    rows.append((f"{tier} batch-1 token: engine wall vs the captured step replayed alone (ms)",
                                 f"{split['engine_ms_per_token_batch1']:.2f} vs {replays}"))
            rows.append((f"physical bound at batch 1: {dec['reasoner_bytes_per_token'] / 1e9:.2f} GB of reasoner weights "
                         f"per token at the measured {dec['measured_hbm_bytes_per_s'] / 1e12:.2f} TB/s (tok/s)",
                         f"{dec['bound_tokens_per_s_batch1']:.0f}"))
    mem = results["memory"]
    gib = 2**30
    rows += [
        ("weights, one instance vs two engines: tiny fp32 (KiB)",
         f"{mem['tiny_fp32']['one_instance'] / 1024:.0f} / {mem['tiny_fp32']['two_instances'] / 1024:.0f}"),
        ("same, Nano bf16 / Super bf16, counted (GiB)",
         f"{mem['nano_bf16']['one_instance'] / gib:.1f} vs {mem['nano_bf16']['two_instances'] / gib:.1f} / "
         f"{mem['super_bf16']['one_instance'] / gib:.1f} vs {mem['super_bf16']['two_instances'] / gib:.1f}"),
    ]
    if "tiny_peak_rss_kib_one" in mem:
        rows.append(("tiny process peak RSS, one / two instances (MiB)",
                     f"{mem['tiny_peak_rss_kib_one'] / 1024:.0f} / {mem['tiny_peak_rss_kib_two'] / 1024:.0f}"))
    return rows


def _calls(run: dict[str, Any], op: str) -> str:
    """``rows x calls`` of ``op`` in a run, e.g. ``8x63`` (one fused call per step) or ``1x504`` (every row alone)."""
    calls = run.get("call_rows", {}).get(op, {})
    return ", ".join(f"{rows}x{n}" for rows, n in sorted(calls.items(), key=lambda kv: -int(kv[0]))) or "none"


@contextlib.contextmanager
def _profiled(b: Bench, folder: str | None, name: str) -> Iterator[None]:
    """Run the body under torch.profiler when ``folder`` is given; write its op tables there."""
    if folder is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.cuda else [])
    with profile(activities=activities) as prof:
        yield
    averages = prof.key_averages()
    tables = [f"# {name}: ops by host self time", averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if b.cuda:
        tables += [f"# {name}: kernels by device time", averages.table(sort_by="self_device_time_total", row_limit=40)]
    path = Path(folder) / f"{name}_profile.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(tables) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="path of the JSON file to write")
    parser.add_argument("--card", default="cosmos3-nano", choices=["cosmos3-tiny", "cosmos3-nano", "cosmos3-super"])
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--smoke", action="store_true", help="cosmos3-tiny on the CPU, one repeat, small counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=4, help="requests submitted together (section 3)")
    parser.add_argument("--omni-height", type=int, default=None, help="default: the card's")
    parser.add_argument("--omni-width", type=int, default=None, help="default: the card's")
    parser.add_argument("--omni-frames", type=int, default=None, help="omni/concurrent frames; default: 29 at real "
                        "size (the card's 189 is minutes per request), the card's for cosmos3-tiny")
    parser.add_argument("--omni-steps", type=int, default=None, help="default: the card's")
    parser.add_argument("--upsample-tokens", type=int, default=None, help="omni/concurrent: the rewrite's token "
                        "budget (default: the card's, 512; random weights never stop early)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="decode: tokens per chat request")
    parser.add_argument("--decode-tokens-per-step", nargs="+", type=int, default=[1, 8], metavar="N",
                        help="decode: run the graphed tier once per N, N tokens per scheduled step "
                             "(compute.decode_tokens_per_step; 1: every token scheduled)")
    parser.add_argument("--decode-kernels", nargs="+", default=["off"], choices=["off", "triton"],
                        help="decode: run each graphed tier without and/or with the Triton decode kernels "
                             "(compute.fused_ops: triton; fv_cosmos3.decode_kernels)")
    parser.add_argument("--host-profile", action="store_true",
                        help="decode: run each graphed tier's batch 8 once more under cProfile (no device thread) and "
                             "write decode_host_<tier>.txt beside the output: where the host's time goes")
    parser.add_argument("--decode-tiers", nargs="+", default=["eager", "graphed"], choices=["eager", "graphed"],
                        help="decode: which tiers to run (the eager one takes minutes at Nano size)")
    parser.add_argument("--sections", nargs="+", default=["step", "omni", "concurrent", "decode"],
                        choices=["step", "omni", "concurrent", "decode"], help="which of sections 1-4 to run (5 always runs)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="run each section under torch.profiler and write DIR/<section>_profile.txt: the ops "
                        "by host self time and by device time (where a step's time goes); the Engine's ops then run "
                        "on the event loop's thread (no device thread), so the profiler sees them")
    args = parser.parse_args(argv)
    b = Bench(args)
    if b.device.type == "cpu":
        torch.set_num_threads(1)
    results: dict[str, Any] = {
        "card": b.card_id, "device": str(b.device), "precision": b.precision, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(b.device) if b.cuda else None,
        "threads": torch.get_num_threads(), "repeats": b.repeats,
    }
    if b.card_id != "cosmos3-tiny" and not b.cuda:
        results["skipped"] = f"{b.card_id} at real size needs a CUDA device (sections step, omni, concurrent, decode)"
        print(f"skipped: {results['skipped']}")
    else:
        instance = random_instance(b, cosmos3_card(b.card_id))
        sections: list[tuple[str, Callable[[Bench, Cosmos3Instance], dict[str, Any]]]] = [
            ("step", bench_step), ("omni", bench_omni), ("concurrent", bench_concurrent), ("decode", bench_decode)]
        for name, section in sections:
            if name not in args.sections:
                continue
            # One section failing on a device leaves the others' figures (written as they come) and its error.
            try:
                with _profiled(b, args.profile, name):
                    results[name] = section(b, instance)
            except Exception as exc:  # noqa: BLE001
                results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
                print(f"section {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                if b.smoke:
                    raise
            if b.cuda:
                torch.cuda.empty_cache()  # e.g. the diffusers twin's parameters: the Engine's budget reads what is free
            with open(args.output, "w") as handle:
                json.dump(results, handle, indent=2)
    results["memory"] = bench_memory(b)
    where = results["gpu"] or f"CPU, {results['threads']} thread(s)"
    print(f"| measurement ({b.card_id}, {b.precision}, {where}) | value |\n|---|---|")
    for name, value in _rows(results):
        print(f"| {name} | {value} |")
    with open(args.output, "w") as handle:
        json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
