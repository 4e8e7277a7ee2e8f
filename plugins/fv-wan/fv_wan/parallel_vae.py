"""Parallel Wan 2.1 VAE decode: horizontal strips with halo exchange (plan ``vae`` > 1).

Each rank of the replica decodes a strip of latent rows (strip index = rank). The decoder's
layers are local per pixel (RMSNorm over channels, SiLU, nearest upsampling, the causal
time convs) except three kinds, which are made exact:

* every 3x3 causal conv and frame conv reads one row from each neighbour strip
  (``halo_exchange``; zeros at the frame's top and bottom, as its zero padding would);
* the mid-block's attention over all pixels of a frame gathers the strips, attends, and
  keeps its own rows (at the lowest resolution, the cheapest place to gather).

The causal cache goes in and out of the op in the single-device layout (each slot gathered
along its rows), so the decode loop's state, checkpoints and resume are unchanged; the op
splits it again on the way in. Requests' latent heights must divide by the degree. The
Wan 2.2 VAE (residual up-blocks, patchified output) is not split: its cards declare no
``vae`` degree.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fv_kernel.api import ParallelRuntime, StepOp, gather_sequence, halo_exchange, shard_sequence
from fv_wan.models.vae import CausalCache, WanVAE
from fv_wan.models.vae_blocks import AttentionBlock, CausalConv3d, Resample, conv3d

__all__ = ["split_decoder", "parallel_decode_op"]

ROWS = 3  # (B, C, T, H, W): rows are dim 3


def _halo_conv_padded(conv: CausalConv3d, group: Any) -> Any:
    _, pad_h, pad_w = conv.spatial_padding

    def conv_padded(self: CausalConv3d, buffer: torch.Tensor) -> torch.Tensor:
        return conv3d(halo_exchange(buffer, ROWS, pad_h, group), self.weight, self.bias, self.stride, (0, 0, pad_w))

    return types.MethodType(conv_padded, conv)


def _halo_frame_conv(resample: Resample, group: Any) -> Any:
    def frame_conv(self: Resample, x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
        pad_h, pad_w = conv.padding  # type: ignore[misc]
        haloed = halo_exchange(x, ROWS, int(pad_h), group)
        return conv3d(haloed, conv.weight.unsqueeze(2), conv.bias, (1, *conv.stride), (0, 0, int(pad_w)))

    return types.MethodType(frame_conv, resample)


def _gathered_attention(block: AttentionBlock, group: Any) -> Any:
    whole = AttentionBlock.forward

    def forward(self: AttentionBlock, x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(whole(self, gather_sequence(x, ROWS, group)), ROWS, group)

    return types.MethodType(forward, block)


def split_decoder(vae: WanVAE, group: Any) -> None:
    """Make ``vae``'s decoder run on row strips over ``group`` (once; the instance's own copy)."""
    if getattr(vae, "_fv_split_group", None) is group:
        return
    for module in vae.decoder.modules():
        if isinstance(module, CausalConv3d) and module.spatial_padding[1] > 0:
            module.conv_padded = _halo_conv_padded(module, group)  # type: ignore[method-assign]
        elif isinstance(module, Resample) and module.upsample:
            module.frame_conv = _halo_frame_conv(module, group)  # type: ignore[method-assign]
        elif isinstance(module, AttentionBlock):
            module.forward = _gathered_attention(module, group)  # type: ignore[method-assign]
    vae._fv_split_group = group  # type: ignore[attr-defined]


def _gather_rows(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    if tensor.numel() == 0:  # an empty history slot: only its shape grows
        shape = list(tensor.shape)
        shape[ROWS] *= torch.distributed.get_world_size(group)
        return tensor.new_zeros(shape)
    return gather_sequence(tensor, ROWS, group)


def parallel_decode_op(vae: WanVAE, runtime: ParallelRuntime) -> StepOp:
    """``vae_decode_frame`` on this rank's strip; inputs and outputs in the single-device layout."""
    group = runtime.group("replica")
    split_decoder(vae, group)

    def vae_decode_frame(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        # A tiling param is not used: the strips already bound each rank's activations.
        cache_tensors = {
            key[len("cache."):]: shard_sequence(value, ROWS, group) if value.ndim == 5 else value
            for key, value in inputs.items() if key.startswith("cache.")
        }
        cache = CausalCache.from_tensors(cache_tensors) if cache_tensors else vae.new_decode_cache()
        ref = next(vae.parameters())
        z = shard_sequence(inputs["z"], ROWS, group)
        z = vae.denormalize_latents(z.to(device=ref.device, dtype=torch.float32)).to(ref.dtype)
        frames, cache = vae.decode_step(z, cache)
        out = {"frames": _gather_rows((frames.float() / 2 + 0.5).clamp(0, 1), group)}
        if not params.get("last", False):
            out.update({f"cache.{k}": _gather_rows(v, group) if v.ndim == 5 else v for k, v in cache.to_tensors().items()})
        return out

    return StepOp("vae_decode_frame", vae_decode_frame)
