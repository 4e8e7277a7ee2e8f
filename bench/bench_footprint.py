"""Admission's memory estimates against measured CUDA peaks, at real Wan sizes (random weights).

    python bench/bench_footprint.py --json footprint.json     # needs CUDA; prints why and exits 0 without

For each case the module runs once on the GPU with random weights; ``measured`` is
``torch.cuda.max_memory_allocated()`` during the call minus what was allocated before
it (weights, inputs, and for a VAE decode step the history of the previous steps).
``estimated`` is the figure admission reserves for that call (``fv_wan.footprint``):
the DiT forward's peak with its fp32 output, the decode step's peak (new history
included), the encoder's peak. A ratio >= 1 means the reservation covers the call.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Callable

import torch

from fv_wan import footprint
from fv_wan.models.transformer import WanTransformer, WanTransformerConfig
from fv_wan.models.vae import CausalCache, WanVAE, WanVAEConfig


def _materialise(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    module = module.to_empty(device="cuda").to(dtype)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.normal_(0, 0.02)
    return module.eval().requires_grad_(False)


def _measure(call: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes allocated during ``call`` above what was allocated before it, its result)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.inference_mode():
        result = call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


def dit_case(name: str, config: WanTransformerConfig, frames: int, height: int, width: int, per_token: bool) -> dict[str, Any]:
    with torch.device("meta"):
        model = WanTransformer(config)
    model = _materialise(model, torch.bfloat16)
    model.rope.build_tables("cuda")
    t_lat, h, w = (frames - 1) // 4 + 1, height // (16 if config.in_channels == 48 else 8), width // (16 if config.in_channels == 48 else 8)
    x = torch.randn(1, config.in_channels, t_lat, h, w, device="cuda", dtype=torch.bfloat16)
    tokens = t_lat * (h // 2) * (w // 2)
    t = torch.full((1, tokens) if per_token else (1,), 500.0, device="cuda")
    context = torch.randn(1, 512, config.text_dim, device="cuda", dtype=torch.bfloat16)
    measured, _ = _measure(lambda: model(x, t, context).float())
    estimated = footprint.dit_step_peak_bytes(config, tokens, precision="bf16", per_token_timesteps=per_token) + (
        config.out_channels * t_lat * h * w * 4)
    del model
    return {"case": name, "tokens": tokens, "measured": measured, "estimated": estimated}


def decode_case(name: str, config: WanVAEConfig, height: int, width: int, dtype: torch.dtype) -> dict[str, Any]:
    """The decode loop's step op (fv_wan.instance.wan_ops "vae_decode_frame"): the history in, the new history out."""
    with torch.device("meta"):
        vae = WanVAE(config)
    vae = _materialise(vae, dtype)
    s = config.spatial_compression
    h, w = height // s, width // s
    element = torch.empty((), dtype=dtype).element_size()
    outputs: dict[str, torch.Tensor] = {}

    def step(z: torch.Tensor) -> dict[str, torch.Tensor]:
        history = {k[len("cache."):]: v for k, v in outputs.items() if k.startswith("cache.")}
        cache = CausalCache.from_tensors(history) if history else vae.new_decode_cache()
        frames, cache = vae.decode_step(vae.denormalize_latents(z.float()).to(dtype), cache)
        out = {"frames": (frames.float() / 2 + 0.5).clamp(0, 1)}
        out.update({f"cache.{k}": v for k, v in cache.to_tensors(contiguous=False).items()})
        return out

    for _ in range(3):
        z = torch.randn(1, config.z_dim, 1, h, w, device="cuda")
        measured, result = _measure(lambda: step(z))
        outputs = result  # the state now holds this step's outputs; the previous ones are freed
    held = sum(t.numel() * t.element_size() for k, t in outputs.items() if k.startswith("cache."))
    estimate = footprint.vae_decode_step(config, h, w, element=element)
    out = config.video_channels * config.temporal_compression * height * width * (element + 2 * 4)
    estimated = estimate.activation_bytes + estimate.cache_bytes + out  # WanDecodeLoop.estimate
    del vae
    return {"case": name, "measured": measured, "estimated": estimated,
            "cache_measured": held, "cache_estimated": estimate.cache_bytes}


def encode_case(name: str, config: WanVAEConfig, frames: int, height: int, width: int) -> dict[str, Any]:
    with torch.device("meta"):
        vae = WanVAE(config)
    vae = _materialise(vae, torch.float32)
    video = torch.rand(1, 3, frames, height, width, device="cuda")
    measured, _ = _measure(lambda: vae.encode_latent(video))
    estimated = footprint.vae_encode_peak_bytes(config, height, width, frames=frames, element=4)
    del vae
    return {"case": name, "measured": measured, "estimated": estimated}


def text_case() -> dict[str, Any]:
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                        feed_forward_proj="gated-gelu")
    with torch.device("meta"):
        model = UMT5EncoderModel(config)
    model = _materialise(model, torch.float32)
    ids = torch.randint(0, 1000, (2, 512), device="cuda")
    mask = torch.ones_like(ids)
    measured, _ = _measure(lambda: model(ids, mask).last_hidden_state)
    return {"case": "umt5-xxl x2 rows", "measured": measured, "estimated": footprint.text_encoder_peak_bytes(4096, 512, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--skip", nargs="*", default=[], help="case names to skip")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure")
        return 0
    cases: list[Callable[[], dict[str, Any]]] = [
        lambda: dit_case("dit wan2.1-1.3b 480x832x81", WanTransformerConfig.wan21_t2v_1_3b(), 81, 480, 832, False),
        lambda: dit_case("dit wan2.1-14b 720x1280x81", WanTransformerConfig.wan21_t2v_14b(), 81, 720, 1280, False),
        lambda: dit_case("dit wan2.2-5b 704x1280x121 per-token t", WanTransformerConfig.wan22_ti2v_5b(), 121, 704, 1280, True),
        lambda: decode_case("vae2.1 decode step 480x832 bf16", WanVAEConfig(), 480, 832, torch.bfloat16),
        lambda: decode_case("vae2.1 decode step 720x1280 bf16", WanVAEConfig(), 720, 1280, torch.bfloat16),
        lambda: decode_case("vae2.2 decode step 704x1280 bf16", WanVAEConfig.wan22(), 704, 1280, torch.bfloat16),
        lambda: encode_case("vae2.1 encode 480x832x81 fp32", WanVAEConfig(), 81, 480, 832),
        text_case,
    ]
    rows = []
    for case in cases:
        try:
            row = case()
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"case failed: {type(exc).__name__}: {exc}")
            continue
        row["ratio"] = row["estimated"] / row["measured"] if row["measured"] else math.inf
        rows.append(row)
        extra = ""
        if "cache_measured" in row:
            extra = f"  history measured {row['cache_measured'] / 2**30:.3f} GiB, estimated {row['cache_estimated'] / 2**30:.3f} GiB"
        print(f"{row['case']:45s} measured {row['measured'] / 2**30:7.3f} GiB  estimated {row['estimated'] / 2**30:7.3f} GiB"
              f"  ratio {row['ratio']:.2f}{extra}", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
