"""Parallel speed-ups on 2, 4 or 8 GPUs over the same code on one GPU, chosen by the world size.

Random weights at real sizes, bf16, the fv code paths the plans run (``fv_wan.parallel``:
the sequence-parallel forward and the CFG-parallel DiT op; ``fv_wan.parallel_vae``: the
row-strip decode op; ``SpmdEngine`` for the whole request). Each figure is the single-GPU
time of the same code divided by the parallel time, measured in the same run (CUDA events
on rank 0, after warm-up, median of ``--iters``). A denoise step "with CFG" is two DiT
rows: one after the other on one GPU (the cards' sequential CFG dispatch).

Launched on 2 ranks:

- ``dit_1.3b_sp2``: Wan2.1-1.3B, one denoise forward at 480x832x81 (32,760 tokens);
- ``dit_1.3b_cfgp2``: the same with CFG (two rows: two forwards on one GPU, one per GPU);
- ``dit_14b_sp2``: Wan2.1-14B at 720x1280x81 (75,600 tokens);
- ``vae_decode_vae2``: the Wan 2.1 VAE decoding 81 frames (21 latent frames) at 480x832.

Launched on 4 ranks (issue 20's 4-GPU figures):

- ``dit_14b_sp4``: Wan2.1-14B 720x1280x81 denoise step with CFG, ``sp=4``;
- ``dit_1.3b_sp4``: Wan2.1-1.3B 480x832x81 denoise step with CFG, ``sp=4``, with the share
  of the parallel step spent in the Ulysses all-to-alls (``all_to_all_share``; each
  ``all_to_all_single`` timed by CUDA events around it: it includes waiting for the
  slowest peer).

Launched on 8 ranks (issue 20's 8-GPU figures; the sp=4 cases run as two concurrent sp=4
replicas, ``dp=2``, timed on the first):

- ``dit_14b_sp8``, ``dit_14b_sp4_cfgp2``, ``dit_14b_sp4``: Wan2.1-14B 720x1280x81 step with CFG;
- ``dit_1.3b_sp4``: as on 4 ranks;
- ``vae_decode_vae8``: the Wan 2.1 VAE decoding 81 frames at 704x1280, split over 8 ranks,
  with the peak memory per GPU. 720p itself is refused under ``vae=8`` (its 90 latent rows
  do not divide by 8: ``ParallelPlanError`` on ``parallel.vae``); 704 is the nearest height
  whose 88 rows do;
- ``e2e_14b_720p``: one whole Wan2.1-14B 720x1280x81 request (``--e2e-steps``, default 50,
  CFG 5.0) through the Engine on one GPU, then through an ``SpmdEngine`` under
  ``--e2e-plan`` (default ``sp8``) on all 8: real-size UMT5 text encoder, DiT and VAE with
  random weights. The 1-GPU run of 50 steps takes long (about 100 DiT forwards at 75,600
  tokens); ``--e2e-steps`` shortens both runs alike.

The script records ``nvidia-smi topo -m`` and the NCCL version, and keeps NVLink multicast
off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``)
in its own environment before NCCL starts, and so in every process it starts. Run::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 8 bench/bench_parallel.py --out parallel8.json

(``--nproc-per-node 2`` or ``4`` for the other sets). Without as many CUDA devices as ranks
it prints that nothing was measured and exits 0 (``skipped``). ``--smoke`` runs the same
code on CPU with gloo at tiny sizes (``torchrun --nproc-per-node N bench/bench_parallel.py
--smoke`` for N = 2, 4 or 8) to check the script end to end; its times mean nothing.

Single-GPU baselines (``--baselines``, issue 37: where only one-GPU hosts are lent). One plain
process, no torchrun, no process group::

    python bench/bench_parallel.py --baselines --out baselines.json [--only NAME ...]

times on one GPU the 1-GPU side of each 2-rank figure, through the functions the 2-rank run
times it with (``_dit_single_step`` + ``_time_dit``; ``_vae_model``, ``_whole_decode_step``,
``_decode_stream`` + ``_time_decode``): ``dit_1.3b_sp2``'s denoise forward at 480x832x81,
``dit_1.3b_cfgp2``'s two-row CFG step, ``dit_14b_sp2``'s forward at 720x1280x81 (bf16: ~28 GB
of weights) and ``vae_decode_vae2``'s decode of 81 frames at 480x832 (one decoder resident,
where the 2-rank run holds two). Each row has ``status`` (``measured``, ``out_of_memory`` or
``error``, with ``error``'s text), ``single_s``, ``peak_gib`` (the peak allocation of the case,
weights included; up to the failure for a failed case) and ``parallel_s`` and ``speedup`` null:
the report says ``"parallel_measured": false``. It records the device, its memory and the
torch, CUDA and cuDNN versions. Cases are independent: one that fails is recorded and the
next still runs. Exit status 0 when every case was measured, 1 when one was not (the report
is written either way); without a CUDA device it prints ``skipped`` and exits 0.
``--baselines --smoke`` runs the same functions on CPU at tiny sizes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: Speed-up targets by case (issue 20 for 4 and 8 ranks; the vae8 decode and the Engine run have none).
TARGETS: dict[str, float | None] = {
    "dit_1.3b_sp2": 1.8, "dit_1.3b_cfgp2": 1.85, "dit_14b_sp2": 1.9, "vae_decode_vae2": 1.6,
    "dit_14b_sp4": 3.5, "dit_1.3b_sp4": 3.3,
    "dit_14b_sp8": 6.5, "dit_14b_sp4_cfgp2": 6.5, "vae_decode_vae8": None, "e2e_14b_720p": None,
}
#: Which cases each launched world size runs.
CASES_BY_WORLD = {
    2: ("dit_1.3b_sp2", "dit_1.3b_cfgp2", "dit_14b_sp2", "vae_decode_vae2"),
    4: ("dit_14b_sp4", "dit_1.3b_sp4"),
    8: ("dit_14b_sp8", "dit_14b_sp4_cfgp2", "dit_14b_sp4", "dit_1.3b_sp4", "vae_decode_vae8", "e2e_14b_720p"),
}
#: The VAE decode's latent shape (frames, rows, cols) by world size: 480x832 on 2 ranks (60 rows / 2);
#: 704x1280 on 8 (88 rows / 8), because 720p's 90 latent rows do not divide by 8 (vae=8 is refused there).
VAE_LATENT = {2: (21, 60, 104), 8: (21, 88, 160)}
#: NVLink multicast off: set in this process before NCCL starts, so every child inherits it too.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _grouped() -> bool:
    """Whether a process group runs (torchrun); ``--baselines`` runs alone, without one."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _timed(fn: Callable[[], Any], *, warmup: int, iters: int, cuda: bool) -> float:
    """Median seconds of ``fn`` (every rank runs it; collectives inside keep them in step)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if _grouped():
            dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _transformer(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from fv_wan.models.transformer import WanTransformer, cast_for_inference

    torch.manual_seed(0)  # the same random weights on every rank
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the compute dtype: no full-size fp32 copy of 14B
    try:
        with torch.device(device):
            model = WanTransformer(config)
    finally:
        torch.set_default_dtype(previous)
    model.rope.build_tables(device)
    return cast_for_inference(model, dtype).eval()


def _dit_inputs(config: Any, latent: tuple[int, int, int], rows: int, device: torch.device, dtype: torch.dtype,
                text_tokens: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    frames, height, width = latent
    x = torch.randn(1, config.in_channels, frames, height, width, generator=generator).expand(rows, -1, -1, -1, -1)
    context = torch.randn(rows, text_tokens, config.text_dim, generator=generator)
    return {"x": x.to(device, dtype), "t": torch.full((rows,), 500.0, device=device),
            "context": context.to(device, dtype)}


def _tokens(latent: tuple[int, int, int]) -> int:
    """The DiT's sequence length: the 1x2x2 patches of the latent."""
    return latent[0] * (latent[1] // 2) * (latent[2] // 2)


def _pixel_shape(latent: tuple[int, int, int]) -> str:
    """HxWxF of the video a latent stands for (the Wan VAE: 8x in space, 4x in time after the first frame)."""
    frames, height, width = latent
    return f"{height * 8}x{width * 8}x{(frames - 1) * 4 + 1}"


def _dit_single_step(config: Any, latent: tuple[int, int, int], *, cfg: bool, args: argparse.Namespace,
                     device: torch.device, dtype: torch.dtype
                     ) -> tuple[Any, dict[str, torch.Tensor], int, Callable[[], list[torch.Tensor]]]:
    """The model, the step's inputs, its rows and the step on one GPU: the 1-GPU side of every DiT figure.

    With CFG the two rows run one after the other (the cards' sequential CFG dispatch).
    ``bench_dit`` times it against the plan; ``--baselines`` times it alone.
    """
    model = _transformer(config, device, dtype)
    rows = 2 if cfg else 1
    inputs = _dit_inputs(config, latent, rows, device, dtype, args.text_tokens)

    def single() -> list[torch.Tensor]:
        return [model(inputs["x"][i : i + 1], inputs["t"][i : i + 1], inputs["context"][i : i + 1]) for i in range(rows)]

    return model, inputs, rows, single


def _time_dit(step: Callable[[], Any], args: argparse.Namespace, device: torch.device) -> float:
    return _timed(step, warmup=args.warmup, iters=args.iters, cuda=device.type == "cuda")


class _AllToAllTimer:
    """Times every ``all_to_all_single`` while active (the Ulysses exchanges of the SP step).

    A bench-only wrap of ``torch.distributed.all_to_all_single``, restored on exit. On CUDA
    each call is bracketed by events on the current stream (its time includes waiting for
    the slowest peer); on CPU (gloo, blocking) by the wall clock.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.events: list[Any] = []
        self.cpu_seconds = 0.0
        self.calls = 0

    def __enter__(self) -> "_AllToAllTimer":
        import torch.distributed as dist

        self._original = dist.all_to_all_single

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = self._original(*args, **kwargs)
                end.record()
                self.events.append((start, end))
                return out
            began = time.perf_counter()
            out = self._original(*args, **kwargs)
            self.cpu_seconds += time.perf_counter() - began
            return out

        dist.all_to_all_single = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        dist.all_to_all_single = self._original

    def seconds(self) -> float:
        if not self.cuda:
            return self.cpu_seconds
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events) / 1000.0


def bench_dit(name: str, config: Any, latent: tuple[int, int, int], *, cfg: bool, plan: Any, args: argparse.Namespace,
              device: torch.device, dtype: torch.dtype, single_cache: dict[Any, float],
              all_to_all_share: bool = False) -> dict[str, Any]:
    """One denoise step (CFG: two rows) under ``plan`` against the same rows one after another on one GPU.

    ``single_cache`` keeps the one-GPU time per model and shape: the 14B cases share it.
    """
    from fv_kernel.parallel import compile_mesh
    from fv_wan.parallel import parallel_dit_op

    model, inputs, rows, single = _dit_single_step(config, latent, cfg=cfg, args=args, device=device, dtype=dtype)
    runtime = compile_mesh(plan, device.type)
    cuda = device.type == "cuda"
    op = parallel_dit_op("transformer", model, runtime)
    with torch.inference_mode():
        def parallel() -> Any:  # this rank's CFG rows and sequence chunk; rows gathered back in order
            return op.fn(inputs, {"dispatch": "sequential"})

        # Numerics first: the plan's output against the single-GPU one.
        reference = torch.cat(single()).float()
        got = parallel()["v"].float()
        max_diff = float((got - reference).abs().max())
        key = (config, latent, rows)
        if key not in single_cache:
            single_cache[key] = _time_dit(single, args, device)
        one = single_cache[key]
        many = _time_dit(parallel, args, device)
        row: dict[str, Any] = {}
        if all_to_all_share:
            import torch.distributed as dist

            dist.barrier()
            with _AllToAllTimer(cuda) as timer:
                whole = _timed(parallel, warmup=0, iters=1, cuda=cuda)
            exchanged = timer.seconds()
            row.update({"all_to_all_s": exchanged, "all_to_all_calls": timer.calls, "step_s_timed_with_a2a": whole,
                        "all_to_all_share": exchanged / whole})
    return {"name": name, "plan": plan.label(), "ranks": plan.world_size // plan.dp, "tokens": _tokens(latent),
            "rows": rows,
            "single_s": one, "parallel_s": many, "speedup": one / many, "max_abs_diff_vs_single": max_diff, **row}


def _peak_gib_max_over_ranks(device: torch.device) -> float | None:
    """The highest peak allocation of any rank since the last reset, in GiB (CUDA only; alone, this process's)."""
    if device.type != "cuda":
        return None
    import torch.distributed as dist

    peak = torch.tensor([float(torch.cuda.max_memory_allocated(device))], device=device)
    if _grouped():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item()) / 2**30


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


DecodeStep = Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]]


def _vae_model(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from fv_wan.models.vae import WanVAE

    torch.manual_seed(2)  # the same random weights for the whole and the split decoder, on every rank
    with torch.device(device):
        return WanVAE(config).to(dtype).eval()


def _vae_latents(config: Any, latent: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    frames, height, width = latent
    return torch.randn(1, config.z_dim, frames, height, width, generator=torch.Generator().manual_seed(3)).to(device)


def _decode_stream(z: torch.Tensor, step: DecodeStep) -> torch.Tensor:
    """Decodes ``z`` a latent frame at a time through ``step``, the causal cache carried as tensors (the op's protocol)."""
    frames = z.shape[2]
    cache: dict[str, torch.Tensor] = {}
    out = []
    for index in range(frames):
        result = step({"z": z[:, :, index : index + 1], **{f"cache.{k}": v for k, v in cache.items()}},
                      {"last": index == frames - 1})
        cache = {k[len("cache."):]: v for k, v in result.items() if k.startswith("cache.")}
        out.append(result["frames"])
    return torch.cat(out, dim=2)


def _whole_decode_step(vae: Any, dtype: torch.dtype) -> DecodeStep:
    """One GPU's decode step: the 1-GPU side of the VAE figure (``bench_vae``, ``--baselines``)."""
    from fv_wan.models.vae import CausalCache

    def whole_step(inputs: dict[str, torch.Tensor], params: dict[str, Any]) -> dict[str, torch.Tensor]:
        tensors = {k[len("cache."):]: v for k, v in inputs.items() if k.startswith("cache.")}
        cache = CausalCache.from_tensors(tensors) if tensors else vae.new_decode_cache()
        z_frame = vae.denormalize_latents(inputs["z"].float()).to(dtype)
        decoded, cache = vae.decode_step(z_frame, cache)
        out = {"frames": (decoded.float() / 2 + 0.5).clamp(0, 1)}
        if not params["last"]:
            out.update({f"cache.{k}": v for k, v in cache.to_tensors().items()})
        return out

    return whole_step


def _time_decode(decode: Callable[[], torch.Tensor], args: argparse.Namespace, device: torch.device) -> float:
    # A whole video per call: one warm-up and half the iterations of the DiT steps.
    return _timed(decode, warmup=1, iters=max(1, args.iters // 2), cuda=device.type == "cuda")


def bench_vae(config: Any, latent: tuple[int, int, int], *, ranks: int, args: argparse.Namespace, device: torch.device,
              dtype: torch.dtype) -> dict[str, Any]:
    from fv_kernel.parallel import ParallelPlan, compile_mesh
    from fv_wan.parallel_vae import parallel_decode_op

    whole_vae, split_vae = _vae_model(config, device, dtype), _vae_model(config, device, dtype)
    runtime = compile_mesh(ParallelPlan(sp=ranks, vae=ranks), device.type)
    split = parallel_decode_op(split_vae, runtime)
    z = _vae_latents(config, latent, device)
    whole_step = _whole_decode_step(whole_vae, dtype)

    with torch.inference_mode():
        _reset_peak(device)
        reference = _decode_stream(z, whole_step)
        peak_single = _peak_gib_max_over_ranks(device)
        _reset_peak(device)
        got = _decode_stream(z, split.fn)
        peak_split = _peak_gib_max_over_ranks(device)
        max_diff = float((got - reference).abs().max())
        del got
        one = _time_decode(lambda: _decode_stream(z, whole_step), args, device)
        two = _time_decode(lambda: _decode_stream(z, split.fn), args, device)
    # Peaks include both VAEs' weights (about 0.5 GB in bf16), the latents and the output video on the GPU.
    return {"name": f"vae_decode_vae{ranks}", "plan": f"vae{ranks}", "latent": list(latent),
            "pixel_frames": int(reference.shape[2]), "pixel_size": [int(reference.shape[3]), int(reference.shape[4])],
            "single_s": one, "parallel_s": two, "speedup": one / two, "max_abs_diff_vs_single": max_diff,
            "peak_gib_single": peak_single, "peak_gib_per_gpu_split": peak_split}


def _random_instance(card: Any, device: torch.device, *, smoke: bool) -> Any:
    """The card made resident with random weights: the tiny card's own seeded ones, or real-size ones built on the device."""
    from fv_kernel.model.options import InstanceOptions
    from fv_kernel.model.instance import ModelInstance, build_instance
    from fv_wan.instance import _component_dtype, wan_ops
    from fv_wan.models.transformer import WanTransformerConfig
    from fv_wan.models.vae import WanVAE, WanVAEConfig

    if smoke:
        return build_instance(card, InstanceOptions(device="cpu", precision="fp32"))
    options = InstanceOptions(device=str(device), precision="bf16")

    def load(component_id: str) -> Any:
        spec = card.components[component_id]
        dtype = _component_dtype(card, component_id, options)
        if spec.kind == "dit":
            return _transformer(WanTransformerConfig.from_diffusers_config(spec.config), device, dtype)
        if spec.kind == "vae":
            torch.manual_seed(2)
            with torch.device(device):
                vae = WanVAE(WanVAEConfig.from_diffusers_config(spec.config))
            vae.encoder = None  # type: ignore[assignment]  # text-to-video decodes only
            vae.quant_conv = None  # type: ignore[assignment]
            return vae.to(dtype).eval().requires_grad_(False)
        if spec.kind == "text_encoder":
            return _umt5_xxl(device, dtype)
        raise ValueError(f"unexpected component kind {spec.kind!r}")

    return ModelInstance(card=card, options=options, component_loader=load, ops_builder=wan_ops,
                         weights_version="random-on-device")


def _umt5_xxl(device: torch.device, dtype: torch.dtype) -> Any:
    """Wan's text tower at real size (UMT5-XXL encoder: 24 layers, d_model 4096), random weights, built on the device."""
    from transformers import UMT5Config, UMT5EncoderModel

    from fv_wan.models.encoders import ByteTokenizer, WanTextEncoder

    config = UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                        relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
                        feed_forward_proj="gated-gelu", pad_token_id=ByteTokenizer.pad_token_id,
                        eos_token_id=ByteTokenizer.eos_token_id)
    torch.manual_seed(3)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = UMT5EncoderModel(config)
    finally:
        torch.set_default_dtype(previous)
    # Byte-level ids are a subset of the real vocabulary: the encoder's cost is the real one.
    return WanTextEncoder(model.eval().requires_grad_(False), ByteTokenizer())


def bench_e2e(*, plan: Any, smoke: bool, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One whole request through the Engine on rank 0 alone, then through an SpmdEngine on every rank under ``plan``."""
    import torch.distributed as dist

    from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart, run_concurrently
    from fv_kernel.parallel import compile_mesh
    from fv_kernel.parallel.engine import SpmdEngine
    from fv_kernel.parallel.spmd import SpmdLeader, parallel_instance, serve_worker
    from fv_kernel.runtime.engine import Engine
    from fv_kernel.runtime.scheduler import SchedulerConfig
    from fv_wan.cards import wan_cards

    card = next(c for c in wan_cards() if c.model_id == ("wan-tiny" if smoke else "wan2.1-t2v-14b"))
    height, width, frames = (32, 32, 5) if smoke else (card.capabilities.defaults.height, card.capabilities.defaults.width,
                                                      card.capabilities.defaults.frames)
    scheduler = SchedulerConfig(scheduling="request", device_thread=False)
    rank = dist.get_rank()

    def request(tag: str, steps: int) -> Any:
        return Request(request_id=tag, model=card.model_id, task=TaskType.TEXT_TO_VIDEO,
                       inputs=(TextPart(text="a lighthouse at dusk, waves breaking on the rocks"),),
                       diffusion=DiffusionParams(height=height, width=width, frames=frames, steps=steps, guidance=5.0,
                                                 seed=7))

    def run(engine: Any) -> tuple[float, Any]:
        warm = run_concurrently(engine, [request("warm", 1)])  # loads every component, outside the time
        assert warm[0].status == "completed", warm[0].error
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        result = run_concurrently(engine, [request("timed", args.e2e_steps)])[0]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if result.status != "completed":
            raise RuntimeError(f"the timed request failed: {result.error}")
        return time.perf_counter() - began, result.artifact("video").frames.float().cpu()

    single_s, single_video = None, None
    if rank == 0:  # the 1-GPU figure: the ordinary Engine, the other ranks wait at the barrier
        engine = Engine(scheduler)
        engine.add_instance(_random_instance(card, device, smoke=smoke))
        single_s, single_video = run(engine)
        del engine
        gc.collect()  # the single-GPU instance's 14B weights go before the plan's are built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    runtime = compile_mesh(plan, device.type)
    leader = SpmdLeader(runtime, []) if runtime.is_leader else None
    instance = parallel_instance(_random_instance(card, device, smoke=smoke), runtime, index=0, leader=leader)
    if leader is None:
        serve_worker(runtime, [instance])
        return {}
    leader.instances.append(instance)
    engine = SpmdEngine(scheduler, leader=leader)
    engine.add_instance(instance)
    try:
        many_s, video = run(engine)
    finally:
        leader.shutdown()
    assert single_s is not None and single_video is not None
    return {"name": "e2e_14b_720p", "card": card.model_id, "plan": plan.label(), "ranks": plan.world_size,
            "shape": f"{height}x{width}x{frames}", "steps": args.e2e_steps, "guidance": 5.0,
            "single_s": single_s, "parallel_s": many_s, "speedup": single_s / many_s,
            "max_abs_diff_vs_single": float((video - single_video).abs().max())}


def _topology() -> dict[str, Any]:
    """``nvidia-smi topo -m`` and the NCCL version, as far as this host has them."""
    out: dict[str, Any] = {}
    try:
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60, check=False)
        out["nvidia_smi_topo"] = done.stdout if done.returncode == 0 else f"rc {done.returncode}: {done.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["nvidia_smi_topo"] = f"unavailable: {exc}"
    try:
        version = torch.cuda.nccl.version()
        out["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception as exc:  # noqa: BLE001 - a CPU-only build has no NCCL
        out["nccl_version"] = f"unavailable: {type(exc).__name__}"
    return out


def _cases(world: int, smoke: bool) -> dict[str, tuple[Any, tuple[int, int, int], bool, dict[str, int]]]:
    """name -> (transformer config, latent frames x rows x cols, CFG, plan degrees) for this world size."""
    from fv_wan.models.transformer import WanTransformerConfig

    if smoke:  # tiny, with 8 heads so every Ulysses degree here divides them; tokens divide by 8
        tiny = WanTransformerConfig(**{**WanTransformerConfig.tiny().model_dump(), "num_attention_heads": 8})
        small, big = (tiny, (2, 8, 8)), (tiny, (2, 8, 16))
    else:
        small = (WanTransformerConfig.wan21_t2v_1_3b(), (21, 60, 104))  # 480x832x81: 32,760 tokens
        big = (WanTransformerConfig.wan21_t2v_14b(), (21, 90, 160))  # 720x1280x81: 75,600 tokens
    replicas = world // 4  # the sp=4 cases on 8 ranks: two concurrent replicas
    table = {
        "dit_1.3b_sp2": (*small, False, {"sp": 2}),
        "dit_1.3b_cfgp2": (*small, True, {"cfgp": 2}),
        "dit_14b_sp2": (*big, False, {"sp": 2}),
        "dit_14b_sp4": (*big, True, {"sp": 4, "dp": replicas}),
        "dit_1.3b_sp4": (*small, True, {"sp": 4, "dp": replicas}),
        "dit_14b_sp8": (*big, True, {"sp": 8}),
        "dit_14b_sp4_cfgp2": (*big, True, {"sp": 4, "cfgp": 2}),
    }
    return {name: case for name, case in table.items() if name in CASES_BY_WORLD[world]}


def _vae_case(world: int, smoke: bool) -> tuple[Any, tuple[int, int, int]]:
    """The VAE config and the latent (frames, rows, cols) it decodes for this world size."""
    from fv_wan.models.vae import WanVAEConfig

    if smoke:  # 8 latent rows: a one-row strip per rank at vae=8 (and the 2-rank case's 4 rows at vae=2)
        tiny = WanVAEConfig(base_dim=8, z_dim=16, dim_mult=(1, 2, 2, 2), num_res_blocks=1, attn_scales=())
        return tiny, ((3, 4, 6) if world == 2 else (2, 8, 6))
    return WanVAEConfig.wan21(), VAE_LATENT.get(world, (0, 0, 0))


#: The cases whose single-GPU side ``--baselines`` measures: the 2-rank set (issue 37).
BASELINE_CASES = CASES_BY_WORLD[2]


def baseline_dit(config: Any, latent: tuple[int, int, int], *, cfg: bool, args: argparse.Namespace,
                 device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """``bench_dit``'s 1-GPU side alone: the same model, inputs, step and timing."""
    _, _, _, single = _dit_single_step(config, latent, cfg=cfg, args=args, device=device, dtype=dtype)
    with torch.inference_mode():
        return {"single_s": _time_dit(single, args, device)}


def baseline_vae(config: Any, latent: tuple[int, int, int], *, args: argparse.Namespace, device: torch.device,
                 dtype: torch.dtype) -> dict[str, Any]:
    """``bench_vae``'s 1-GPU side alone: one decoder, the same latents, stream, step and timing."""
    z = _vae_latents(config, latent, device)
    whole_step = _whole_decode_step(_vae_model(config, device, dtype), dtype)
    with torch.inference_mode():
        video = _decode_stream(z, whole_step)  # bench_vae's untimed reference pass
        size = {"pixel_frames": int(video.shape[2]), "pixel_size": [int(video.shape[3]), int(video.shape[4])]}
        del video
        return {"single_s": _time_decode(lambda: _decode_stream(z, whole_step), args, device), **size}


def _measure_case(row: dict[str, Any], measure: Callable[[], dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Runs one baseline into ``row``; an error, out of memory included, is recorded there and the next case runs."""
    row.update({"status": "measured", "error": None, "single_s": None, "parallel_s": None, "speedup": None,
                "target": TARGETS[row["name"]]})
    _reset_peak(device)
    try:
        row.update(measure())
    except torch.cuda.OutOfMemoryError as exc:  # the case does not fit one GPU
        row.update({"status": "out_of_memory", "error": f"{type(exc).__name__}: {exc}"})
    except Exception as exc:  # noqa: BLE001 - recorded in its row: one case's failure must not lose the others
        row.update({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
    gc.collect()  # the case's model goes (a failed one's too) before the peak is read and the next case built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # The peak statistic survives the frees: weights included (reset before the build); up to a failure.
    row["peak_gib"] = _peak_gib_max_over_ranks(device)
    return row


def bench_baselines(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The single-GPU times of the 2-rank cases, through the functions the 2-rank run times its 1-GPU side with."""
    from fv_kernel.parallel import ParallelPlan

    cuda = device.type == "cuda"
    dit_cases = _cases(2, args.smoke)
    vae_config, vae_latent = _vae_case(2, args.smoke)
    wanted = set(args.only or BASELINE_CASES)
    results = []
    for name in BASELINE_CASES:
        if name not in wanted:
            continue
        if name in dit_cases:
            config, latent, cfg, degrees = dit_cases[name]
            row = {"name": name, "plan": ParallelPlan(**degrees).label(), "shape": _pixel_shape(latent),
                   "latent": list(latent), "tokens": _tokens(latent), "rows": 2 if cfg else 1}
            measure = functools.partial(baseline_dit, config, latent, cfg=cfg, args=args, device=device, dtype=dtype)
        else:
            row = {"name": name, "plan": "vae2", "shape": _pixel_shape(vae_latent), "latent": list(vae_latent)}
            measure = functools.partial(baseline_vae, vae_config, vae_latent, args=args, device=device, dtype=dtype)
        results.append(_measure_case({**row, "speedup_ranks": 2, "measured_on": "1 GPU" if cuda else "cpu"},
                                     measure, device))
    return {
        "mode": "baselines", "smoke": args.smoke, "world_size": 1, "parallel_measured": False,
        "note": "single-GPU baselines only: no parallel time was measured, so every parallel_s and speedup is null",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "device_total_gib": torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "dtype": str(dtype).removeprefix("torch."), "iters": args.iters, "warmup": args.warmup,
        "text_tokens": args.text_tokens, "date": time.strftime("%Y-%m-%d", time.gmtime()), "results": results,
    }


def main_baselines(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--baselines``: 0 when every case was measured, 1 when one recorded an error (the report is written anyway)."""
    unknown = sorted(set(args.only or ()) - set(BASELINE_CASES))
    if unknown:
        parser.error(f"--baselines measures {', '.join(BASELINE_CASES)}; --only got {', '.join(unknown)}")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        parser.error(f"--baselines runs in one process: launch it with python, not torchrun "
                     f"(got WORLD_SIZE={os.environ['WORLD_SIZE']})")
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        args.text_tokens = 8
    elif not torch.cuda.is_available():
        print(json.dumps({"skipped": "nothing measured: --baselines needs one CUDA GPU, found none "
                                     "(--baselines --smoke runs it on CPU at tiny sizes)"}))
        return 0
    else:
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    report = bench_baselines(args, device, dtype)
    print(f"{report['device']}, torch {report['torch']}, CUDA {report['cuda']}: single-GPU baselines, "
          f"no parallel time measured (speed-ups null)")
    for row in report["results"]:
        if row["status"] != "measured":
            print(f"{row['name']:>18}: {row['status']}: {row['error']}")
            continue
        peak = f"peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else "no peak on CPU"
        print(f"{row['name']:>18}: {row['single_s'] * 1e3:10.1f} ms on {row['measured_on']} at {row['shape']}, {peak} "
              f"(the 1-GPU side of {row['plan']}; target {row['target']}x, speed-up not measured)")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if all(row["status"] == "measured" for row in report["results"]) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (rank 0)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--e2e-steps", type=int, default=50, help="denoise steps of the whole-request case (8 ranks)")
    parser.add_argument("--e2e-plan", default="sp8", choices=["sp8", "sp4_cfgp2"], help="the plan of the whole-request case")
    parser.add_argument("--timeout-min", type=float, default=240.0,
                        help="how long a rank waits at a collective (the 1-GPU whole request keeps the others waiting)")
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny sizes: checks the script, times mean nothing")
    parser.add_argument("--only", nargs="*", default=None, help=f"a subset of {sorted(TARGETS)}")
    parser.add_argument("--baselines", action="store_true",
                        help="one process, one GPU: the single-GPU times of the 2-rank cases, no speed-ups")
    args = parser.parse_args(argv)
    if args.baselines:  # before NO_MULTICAST: no NCCL here, and a caller's environment stays as it was
        return main_baselines(args, parser)

    os.environ.update(NO_MULTICAST)  # before NCCL starts; inherited by every process this one starts
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world not in CASES_BY_WORLD:
        print(json.dumps({"skipped": f"nothing measured: launch on 2, 4 or 8 ranks (torchrun --nproc-per-node N), "
                                     f"got WORLD_SIZE={os.environ.get('WORLD_SIZE')}"}))
        return 0 if world == 0 else 2
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.smoke and gpus < world:
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"skipped": f"nothing measured: {world} ranks need {world} CUDA GPUs, found {gpus}; "
                                         f"run it under torchrun --nproc-per-node {world} on a {world}-GPU host"}))
        return 0

    import datetime

    import torch.distributed as dist
    from fv_kernel.parallel import ParallelPlan

    timeout = datetime.timedelta(minutes=args.timeout_min)
    if args.smoke:
        dist.init_process_group("gloo", timeout=timeout)
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
        args.text_tokens = 8
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout)
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
    vae_config, vae_latent = _vae_case(world, args.smoke)
    wanted = set(args.only or CASES_BY_WORLD[world])
    results: list[dict[str, Any]] = []
    single_cache: dict[Any, float] = {}
    for name, (config, latent, cfg, degrees) in _cases(world, args.smoke).items():
        if name in wanted:
            results.append(bench_dit(name, config, latent, cfg=cfg, plan=ParallelPlan(**degrees), args=args, device=device,
                                     dtype=dtype, single_cache=single_cache, all_to_all_share=name == "dit_1.3b_sp4"))
            if device.type == "cuda":  # the model of the case just run is gone: give its memory back
                torch.cuda.empty_cache()
    vae_case = f"vae_decode_vae{world}"
    if vae_case in CASES_BY_WORLD[world] and vae_case in wanted:
        results.append(bench_vae(vae_config, vae_latent, ranks=world, args=args, device=device, dtype=dtype))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "e2e_14b_720p" in CASES_BY_WORLD[world] and "e2e_14b_720p" in wanted:
        if args.smoke:  # wan-tiny has 2 heads: the same 8 ranks as USP (ulysses 2 x ring 2) x cfgp 2
            plan = ParallelPlan(ulysses=2, ring=2, cfgp=2)
        else:
            plan = ParallelPlan(sp=8) if args.e2e_plan == "sp8" else ParallelPlan(sp=4, cfgp=2)
        row = bench_e2e(plan=plan, smoke=args.smoke, args=args, device=device)
        if row:
            results.append(row)
    if dist.get_rank() == 0:
        for row in results:
            row["target"] = TARGETS[row["name"]]
            target = f"target {row['target']}x" if row["target"] else "no target"
            extra = f", all-to-all {row['all_to_all_share']:.0%} of the step" if "all_to_all_share" in row else ""
            if row.get("peak_gib_per_gpu_split") is not None:
                extra += f", peak {row['peak_gib_single']:.1f} GiB on 1 -> {row['peak_gib_per_gpu_split']:.1f} GiB per GPU"
            print(f"{row['name']:>18}: {row['single_s'] * 1e3:10.1f} ms on 1 -> {row['parallel_s'] * 1e3:10.1f} ms on "
                  f"{row.get('ranks', world)} = {row['speedup']:.2f}x ({target}), max |diff| vs 1 GPU "
                  f"{row['max_abs_diff_vs_single']:.2e}{extra}")
        report = {
            "smoke": args.smoke, "world_size": world,
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "env": {name: os.environ[name] for name in NO_MULTICAST}, **(_topology() if device.type == "cuda" else {}),
            "results": results,
        }
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=2))
    # Every rank leaves its last collective before any tears the group down: a gloo rank that
    # destroyed its group while rank 0 was still reporting aborted once under CI load
    # ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
