"""Wan 2.1 VAE decode: fv eager, fv fused (Triton norm + SiLU) and diffusers, side by side (issue 19 §2).

On CUDA (the H200 run): the real Wan 2.1 VAE with random weights, decoding the 81-frame
latent 21x60x104 in bf16; paths: eager, fused, and each again with the full-resolution
stages run ``--frame-chunk`` frames at a time (``WanVAE.set_decode_frame_chunk``), and fused in exact
halo tiles (``--halo ROWS COLUMNS``, ``WanVAE.decode(halo=...)``) with and without the frame chunks; for each path the median wall time over ``--iters`` decodes and
the peak allocated memory (``torch.cuda.max_memory_allocated`` after a reset, weights
included), the fused path's max abs difference to eager and fv's to diffusers, and the
ratios fv/diffusers the issue's targets are stated in (time <= 0.6x, peak <= 0.5x). What
fv's peak is made of: the resident part (weights, output video, the causal cache at its
largest, each counted from the tensors) and the rest, transient activations and conv
workspace, by difference. Each row's peak holds only its own weights, input and output: the
videos kept for the comparisons wait on the host (before 2026-12-06 they stayed on the device
and counted in the later rows' peaks), and fv's weights leave the device before diffusers runs.

``--cpu`` runs the same rows on the CPU with the real Wan 2.1 decoder in fp32 at a small latent
(default 3x16x16: 9 frames at 128x128): fv's 3D convs go through oneDNN there, diffusers' through
PyTorch's ``slow_conv3d``, so the ratio is what a CPU user gets (the fused rows run the torch
reference ops).

Without CUDA the script prints that it skipped and exits 0, unless ``--smoke`` or ``--cpu``: ``--smoke`` runs
every path at tiny size on CPU (fused = the torch reference ops; times mean nothing) and
reports the decode's *activation* peak, the most bytes of tensor storage alive at once while
decoding, counted op by op (weights and the pre-allocated latent excluded; conv workspace
inside an op is not seen). That CPU figure is what the memory changes can be checked on
without a GPU.

    python bench/bench_vae_decode.py out/vae             # on a CUDA machine
    python bench/bench_vae_decode.py /tmp/vae --smoke    # CPU, tiny
    python bench/bench_vae_decode.py /tmp/vae --cpu      # CPU, the real decoder at 3x16x16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fv_kernel.compute.fused import FusedOps, TorchFusedOps, TritonFusedOps
from fv_wan.models.vae import HaloTiling, WanVAE, WanVAEConfig

GiB = 2**30
#: ``HaloTiling``'s own default: the rows at it carry no ``_align`` suffix.
DEFAULT_ALIGN: int = HaloTiling.model_fields["align"].default

#: Structurally the Wan 2.1 decoder (2 temporal and 3 spatial upsamplings, channel halving,
#: 1x1x1 shortcuts, mid attention) at small widths.
SMOKE_CONFIG = WanVAEConfig(base_dim=8, z_dim=4, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                            latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)  # fmt: skip


class LiveStorageBytes(TorchDispatchMode):
    """Bytes of tensor storage created inside the mode and still alive, and their peak, op by op.

    Frees are seen through weak references to the storages before each op runs, so the peak is
    taken after each op's outputs exist and with every earlier free accounted for.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.bytes = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.bytes -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._sweep()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            known = self.live.get(key)
            if not key or (known is not None and not known[0].expired()):
                continue
            if known is not None:  # an address freed and reused inside this op
                self.bytes -= known[1]
            self.live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        return out


def activation_peak_bytes(decode: Callable[[], Any]) -> int:
    """The most storage bytes alive at once while ``decode()`` runs (the output included)."""
    counter = LiveStorageBytes()
    with counter:
        decode()
    return counter.peak


def _randomise_(vae: WanVAE, seed: int) -> None:
    """Non-trivial weights (default init has unit gammas and zero biases, which hide mistakes)."""
    g = torch.Generator(device=next(vae.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            noise = torch.randn(p.shape, generator=g, device=p.device)
            if name.endswith("gamma"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.05 * noise)
            else:
                p.copy_(noise * (2.0 / max(1, p[0].numel())) ** 0.5)


def random_decoder(config: WanVAEConfig, device: torch.device, dtype: torch.dtype) -> WanVAE:
    """The decoder half of a ``WanVAE`` on seeded random weights, for inference in ``dtype``."""
    with torch.device(device):
        vae = WanVAE(config)
    _randomise_(vae, 2)
    vae.encoder = None  # type: ignore[assignment]
    vae.quant_conv = None  # type: ignore[assignment]
    return vae.to(dtype).eval().requires_grad_(False)


def _time(device: torch.device, fn: Callable[[], Any], iters: int) -> dict[str, Any]:
    """Median ms over ``iters`` calls after one warm-up, and the peak allocated GiB on CUDA."""
    fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    peak = round(torch.cuda.max_memory_allocated() / GiB, 3) if device.type == "cuda" else None
    return {"ms": round(statistics.median(times), 1), "peak_gib": peak}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not (args.smoke or args.cpu) else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype if device.type == "cuda" else "fp32"]
    real = not args.smoke  # the Wan 2.1 decoder (CUDA, or --cpu), else the tiny smoke config
    config = WanVAEConfig.wan21() if real else SMOKE_CONFIG
    latent = (tuple(args.latent or ((21, 60, 104) if device.type == "cuda" else (3, 16, 16)))) if real else (2, 4, 6)
    vae = random_decoder(config, device, dtype)
    g = torch.Generator(device=device).manual_seed(4)
    z = torch.randn(1, config.z_dim, *latent, generator=g, device=device).to(dtype)
    fused: FusedOps = TritonFusedOps() if device.type == "cuda" else TorchFusedOps()
    iters = args.iters if real else 1
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "latent": "x".join(map(str, latent)), "dtype": str(dtype).removeprefix("torch."),
                           "fused_ops": fused.name, "torch": torch.__version__}  # fmt: skip

    with torch.no_grad():
        vae.set_fused_ops(None)
        # Every video kept for a comparison goes to the host: one left on the device would count in the
        # peaks of the rows timed after it.
        eager_video = vae.decode(z).cpu()
        out["fv_eager"] = _time(device, lambda: vae.decode(z), iters)
        vae.set_fused_ops(fused)
        fused_video = vae.decode(z).cpu()
        out["fv_fused"] = _time(device, lambda: vae.decode(z), iters)
        out["fused_max_abs_diff_vs_eager"] = float((fused_video.float() - eager_video.float()).abs().max())
        if args.profile and device.type == "cuda":
            out["fv_fused_profile"] = _profile(vae, z, args.output / "vae_decode_kernels.txt")
        if device.type == "cuda":
            # cuDNN's autotuner picks each conv's algorithm by timing them (first call per shape), instead of its
            # heuristics; other algorithms may sum in another order.
            with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False):
                tuned_video = vae.decode(z).cpu()
                out["fv_fused_cudnn_benchmark"] = _time(device, lambda: vae.decode(z), iters)
            out["cudnn_benchmark_max_abs_diff_vs_fused"] = float((tuned_video.float() - fused_video.float()).abs().max())
            del tuned_video
        if device.type == "cpu":
            for label, ops in (("fv_eager", None), ("fv_fused", fused)):
                vae.set_fused_ops(ops)
                out[label]["activation_peak_mib"] = round(activation_peak_bytes(lambda: vae.decode(z)) / 2**20, 3)
        # The full-resolution stages ``--frame-chunk`` frames at a time (exact; fewer live activations).
        chunk = f"chunk{args.frame_chunk}"
        vae.set_decode_frame_chunk(args.frame_chunk)
        out[f"fv_fused_{chunk}"] = _time(device, lambda: vae.decode(z), iters)
        vae.set_fused_ops(None)
        chunked_video = vae.decode(z).cpu()
        out[f"fv_eager_{chunk}"] = _time(device, lambda: vae.decode(z), iters)
        out[f"eager_{chunk}_max_abs_diff_vs_eager"] = float((chunked_video.float() - eager_video.float()).abs().max())
        if device.type == "cpu":
            for label, ops in ((f"fv_eager_{chunk}", None), (f"fv_fused_{chunk}", fused)):
                vae.set_fused_ops(ops)
                out[label]["activation_peak_mib"] = round(activation_peak_bytes(lambda: vae.decode(z)) / 2**20, 3)
        # Exact halo tiles (``HaloTiling``): one tile's causal history and activations alive at a time.
        halo = HaloTiling(rows=args.halo[0], columns=args.halo[1], align=args.halo_align)
        tiles = _halo_label(args)
        vae.set_fused_ops(fused)
        for frames, label in ((None, f"fv_fused_{tiles}"), (args.frame_chunk, f"fv_fused_{tiles}_{chunk}")):
            vae.set_decode_frame_chunk(frames)
            halo_video = vae.decode(z, halo=halo).cpu()
            out[label] = _time(device, lambda: vae.decode(z, halo=halo), iters)
            out[f"{label}_max_abs_diff_vs_fused"] = float((halo_video.float() - fused_video.float()).abs().max())
            if device.type == "cpu":
                out[label]["activation_peak_mib"] = round(
                    activation_peak_bytes(lambda: vae.decode(z, halo=halo)) / 2**20, 3)
            if args.profile and device.type == "cuda" and frames is None:
                out[f"{label}_profile"] = _profile(vae, z, args.output / f"vae_decode_{tiles}_kernels.txt", halo)
            del halo_video
        vae.set_decode_frame_chunk(None)
        vae.set_fused_ops(None)
        del fused_video, chunked_video
        # What the peak is made of: what must live (weights, the output video, the causal history
        # at its largest) and, by difference on CUDA, the transient activations and conv workspace.
        cache = vae.new_decode_cache()
        for k in range(z.shape[2]):
            _, cache = vae.decode_step(z[:, :, k : k + 1], cache)
        out["resident_mib"] = {
            "weights": round(sum(p.numel() * p.element_size() for p in vae.parameters()) / 2**20, 3),
            "video": round(eager_video.numel() * eager_video.element_size() / 2**20, 3),
            "causal_cache": round(cache.nbytes / 2**20, 3),
        }
        del cache
        if out["fv_eager"]["peak_gib"]:
            out["fv_eager"]["transient_mib"] = round(out["fv_eager"]["peak_gib"] * 1024 - sum(out["resident_mib"].values()), 1)
        try:
            from diffusers import AutoencoderKLWan
        except Exception as exc:  # noqa: BLE001
            out["diffusers"] = f"skipped: {type(exc).__name__}: {exc}"
            return out
        vae.cpu()  # fv's weights leave the device: diffusers' peak counts its own weights only
        with torch.device(device):
            ref = AutoencoderKLWan(**config.to_diffusers_config())
        ref.encoder = None
        ref.quant_conv = None
        missing, unexpected = ref.load_state_dict(vae.state_dict(), strict=False)
        if unexpected or any(not k.startswith(("encoder.", "quant_conv.")) for k in missing):
            raise RuntimeError(f"diffusers decoder keys differ: missing {missing}, unexpected {unexpected}")
        ref = ref.to(dtype).eval()
        ref_video = ref.decode(z, return_dict=False)[0].cpu()
        out["diffusers"] = _time(device, lambda: ref.decode(z, return_dict=False), iters)
        out["fv_max_abs_diff_vs_diffusers"] = float((eager_video.float() - ref_video.float()).abs().max())
        if device.type == "cpu":
            out["diffusers"]["activation_peak_mib"] = round(
                activation_peak_bytes(lambda: ref.decode(z, return_dict=False)) / 2**20, 3)
    tiles = _halo_label(args)
    for label in ("fv_eager", "fv_fused", f"fv_eager_chunk{args.frame_chunk}", f"fv_fused_chunk{args.frame_chunk}",
                  "fv_fused_cudnn_benchmark", f"fv_fused_{tiles}", f"fv_fused_{tiles}_chunk{args.frame_chunk}"):
        if label not in out:
            continue
        out[f"{label}_time_ratio"] = round(out[label]["ms"] / out["diffusers"]["ms"], 3)
        if out[label]["peak_gib"] and out["diffusers"]["peak_gib"]:
            out[f"{label}_peak_ratio"] = round(out[label]["peak_gib"] / out["diffusers"]["peak_gib"], 3)
        if "activation_peak_mib" in out[label]:
            out[f"{label}_activation_peak_ratio"] = round(
                out[label]["activation_peak_mib"] / out["diffusers"]["activation_peak_mib"], 3)
    return out


def _halo_label(args: argparse.Namespace) -> str:
    return f"halo{args.halo[0]}x{args.halo[1]}" + (f"_align{args.halo_align}" if args.halo_align != DEFAULT_ALIGN else "")


def _profile(vae: Any, z: torch.Tensor, path: Path, halo: HaloTiling | None = None) -> dict[str, float]:
    """One decode under torch.profiler: its kernels by device time written to ``path``, and the ms of each kind
    (convolutions, the fused norm, copies and concatenations, other elementwise kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        vae.decode(z, halo=halo)
        torch.cuda.synchronize()
    events = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    # The kernels, then the aten ops that launched them by input shape (which copy, add or conv it was).
    by_shape = prof.key_averages(group_by_input_shape=True)
    path.write_text(events.table(sort_by="self_device_time_total", row_limit=40) + "\n"
                    + by_shape.table(sort_by="device_time_total", row_limit=60, max_name_column_width=40,
                                     max_shapes_column_width=120) + "\n")
    events = [e for e in events if not e.key.startswith("aten::") and e.self_device_time_total > 0]  # the kernels
    kinds = {"conv": ("conv", "implicit_gemm", "xmma", "cutlass", "nvjet", "gemm", "fprop", "dgrad"),
             "fused_norm": ("channel_rms_silu",), "copy_cat": ("copy", "cat", "concat", "pad"),
             "upsample": ("upsample", "nearest")}
    out = {name: 0.0 for name in (*kinds, "other")}
    for e in events:
        key = e.key.lower()
        kind = next((name for name, words in kinds.items() if any(w in key for w in words)), "other")
        out[kind] += e.self_device_time_total / 1000
    out["total"] = sum(out.values())
    return {name: round(ms, 2) for name, ms in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU (times mean nothing)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="CUDA only; CPU runs fp32")
    parser.add_argument("--cpu", action="store_true", help="the real decoder on CPU in fp32 (default latent 3x16x16)")
    parser.add_argument("--latent", type=int, nargs=3, default=None, metavar=("T", "H", "W"),
                        help="default 21 60 104 on CUDA, 3 16 16 with --cpu")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: one fused decode under torch.profiler, its kernels in OUTPUT/vae_decode_kernels.txt, "
                             "and one halo-tiled decode in OUTPUT/vae_decode_halo<R>x<C>_kernels.txt")
    parser.add_argument("--halo", type=int, nargs=2, default=(1, 2), metavar=("ROWS", "COLUMNS"),
                        help="the exact halo-tiled rows (WanVAE.decode(halo=HaloTiling(...)))")
    parser.add_argument("--halo-align", type=int, default=DEFAULT_ALIGN,
                        help="HaloTiling.align: widen the tiles' ranges below full resolution to this multiple")
    parser.add_argument("--frame-chunk", type=int, default=1,
                        help="frames per chunk for the chunked rows (the decoder's full-resolution stages)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not (args.smoke or args.cpu):
        print("bench_vae_decode: no CUDA device; skipped (--cpu: the real decoder on CPU; --smoke: the CPU dry run)")
        return 0
    if args.smoke:
        torch.set_num_threads(1)  # tiny convs: more threads only contend on a shared CPU
    result = run(args)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "vae_decode.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
