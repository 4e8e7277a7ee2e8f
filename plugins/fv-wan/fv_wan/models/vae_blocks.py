"""Building blocks of the Wan 2.1 / 2.2 causal video VAE.

Module and parameter names mirror diffusers' ``AutoencoderKLWan`` so that its
state dict loads with ``strict=True`` and no key map. Behaviour is re-derived
from the reference, not copied, and differs in *how* it computes:

* The causal feature cache is never stored on a module. Every cached layer is
  given a fixed slot index at construction; callers pass a plain list of
  slots (``list[Tensor | None]``) through ``forward`` and the layer reads and
  replaces its own slot. Two requests therefore never share history.
* Activations are channels-last (NDHWC), which cuDNN's 3D convs prefer.
  Frame-wise 2D convs run as depth-1 3D convs on the 5D tensor and spatial
  zero padding is left to the conv, so no permute/pad copies are made.
* Each RMSNorm writes straight into its causal conv's time-padded input
  buffer; nearest upsampling (with the 2x temporal interleave) is one strided
  copy; the 2.2 duplicate-upsample shortcut is added in place without
  materialising it; SiLU and residual adds are in place. This keeps the peak
  working set and memory traffic well below the reference's.
* Peak memory of the decode: a residual block frees conv1's padded input before
  conv2's is allocated; the decoder runs each 2.1 stage's layers itself, so no
  caller frame keeps a stage's input alive through the whole stage; the output
  norm writes straight into conv_out's padded input. All exact (same ops, same
  values), only lifetimes change.
* With fused ops (``Decoder3d.set_fused_ops``, the DiT's ``FusedOps`` switch) each
  norm + SiLU of the decoder is one fused pass (``channel_rms_norm_silu``), and on CUDA each
  conv's bias is added in memory order (``channel_bias_add_``) where cuDNN's bias-free
  convolution was followed by PyTorch's strided broadcast add.

Slot semantics (``CACHE_T = 2``): a slot holds the last two (time-padded) input
frames of a causal conv, which stand in for its left zero padding on the next
chunk; zero frames in a slot are exactly equivalent to that padding.
``None`` means "this stream has not started"; for the temporal resamplers a
zero-frame tensor means "started, but no history yet", reproducing the
reference's ``"Rep"`` marker with a serialisable value.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: A ``fv_kernel.compute.fused.FusedOps`` (duck-typed: the model never imports the kernel's compute
#: module) or None for the eager code.
FusedOps = Any

CACHE_T = 2

SlotList = list[Tensor | None]


class SlotAllocator:
    """Hands out consecutive cache-slot indices while a network is built."""

    def __init__(self) -> None:
        self.count = 0

    def take(self) -> int:
        self.count += 1
        return self.count - 1


def _history_after(previous: Tensor | None, x: Tensor) -> Tensor:
    """Last ``CACHE_T`` frames of ``cat(previous, x)`` as a tensor that owns its memory.

    A fresh tensor is returned so the slot never pins the (larger) storage of ``x``.
    """
    frames = x.shape[2]
    if frames >= CACHE_T or previous is None or previous.shape[2] == 0:
        return x[:, :, -CACHE_T:].clone()
    keep = CACHE_T - frames
    return torch.cat([previous[:, :, -keep:].to(x.device), x], dim=2)


def conv3d(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, ...], padding: tuple[int, ...]) -> Tensor:
    """``F.conv3d`` (no dilation, one group), through oneDNN for fp32 on the CPU.

    PyTorch's CPU dispatch sends these convs to its im2col ``slow_conv3d``, several times slower than
    oneDNN at narrow layers: the toy VAE's chunk decode in a realtime CPU session took 0.356 s that
    way and 0.038 s this way (docs/benchmarks.md). Same math, another summation order: results agree
    to ~1e-6 relative. Autograd works through it (the op has a derivative).
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available() \
            and torch.backends.mkldnn.enabled:
        return torch.ops.aten.mkldnn_convolution(x, weight, bias, list(padding), list(stride), [1, 1, 1], 1)
    return F.conv3d(x, weight, bias, stride, padding)


def _splits_bias(x: Tensor, fused_ops: FusedOps, *params: Tensor | None) -> bool:
    """Whether a conv of ``x`` adds its bias through ``fused_ops.channel_bias_add_``: on CUDA (where a conv with a
    bias already runs as a bias-free convolution, then a broadcast add) or in Triton's interpreter, never while
    autograd records (the fused kernels record no gradient). On the CPU oneDNN adds the bias inside the conv."""
    if fused_ops is None:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        return False
    return x.device.type == "cuda" or bool(getattr(fused_ops, "interpreted", False))


def _conv_with_bias(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, ...], padding: tuple[int, ...],
                    fused_ops: FusedOps) -> Tensor:
    """:func:`conv3d`, its bias added by the fused ops where :func:`_splits_bias` says so."""
    if bias is None or not _splits_bias(x, fused_ops, weight, bias):
        return conv3d(x, weight, bias, stride, padding)
    return fused_ops.channel_bias_add_(conv3d(x, weight, None, stride, padding), bias)


def _empty_activation(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """Activations are kept channels-last (NDHWC): cuDNN's 3D convs run ~20-30% faster on it."""
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=torch.channels_last_3d)


class CausalConv3d(nn.Conv3d):
    """3D convolution that is causal in time: time is padded (2p, 0), space (p, p).

    Earlier input frames (``history``) replace as many of the leading zero
    frames as they cover, so chunked processing equals processing at once.
    Spatial zero padding is left to the convolution itself (no padded copy).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int, int],
        stride: int | tuple[int, int, int] = 1,
        padding: int | tuple[int, int, int] = 0,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding)
        #: The decoder's fused ops (``Decoder3d.set_fused_ops``): the bias is then added by them.
        self.fused_ops: FusedOps = None
        pad_t, pad_h, pad_w = self.padding  # normalised to a triple by nn.Conv3d
        self.causal_time_pad = 2 * pad_t
        self.spatial_padding = (0, pad_h, pad_w)

    def padded_input(self, like: Tensor, frames: int, history: Tensor | None) -> tuple[Tensor, Tensor]:
        """A ``[zeros | history | new frames]`` buffer and the view its new frames go into.

        ``like`` gives batch, spatial size, dtype and device. Producers write the
        conv input straight into the view, so no separate padded copy is made.
        """
        pad = self.causal_time_pad
        b, _, _, h, w = like.shape
        buffer = _empty_activation((b, self.in_channels, pad + frames, h, w), like)
        have = 0 if history is None else min(history.shape[2], pad)
        if pad - have:
            buffer[:, :, : pad - have].zero_()
        if have:
            assert history is not None
            buffer[:, :, pad - have : pad].copy_(history[:, :, -have:])
        return buffer, buffer[:, :, pad:]

    def conv_padded(self, buffer: Tensor) -> Tensor:
        return _conv_with_bias(buffer, self.weight, self.bias, self.stride, self.spatial_padding, self.fused_ops)

    def forward(self, x: Tensor, history: Tensor | None = None) -> Tensor:  # type: ignore[override]
        if self.causal_time_pad == 0:
            return self.conv_padded(x)
        buffer, new_frames = self.padded_input(x, x.shape[2], history)
        new_frames.copy_(x)
        return self.conv_padded(buffer)


class CachedCausalConv3d(CausalConv3d):
    """A causal conv that owns one cache slot and updates it on every call.

    The slot keeps the last ``CACHE_T`` frames of the padded input; zero frames
    in it are exactly equivalent to the zero padding they stand for.
    """

    def __init__(self, *args: object, slots: SlotAllocator, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.slot = slots.take()

    def input_buffer(self, like: Tensor, cache: SlotList) -> tuple[Tensor, Tensor]:
        """Buffer (with this slot's history) for ``like.shape[2]`` new frames, and its new-frame view."""
        return self.padded_input(like, like.shape[2], cache[self.slot])

    def run_buffer(self, buffer: Tensor, cache: SlotList) -> Tensor:
        """Convolve a filled buffer from :meth:`input_buffer`, remembering its tail."""
        cache[self.slot] = buffer[:, :, -CACHE_T:].clone()
        return self.conv_padded(buffer)

    def forward(self, x: Tensor, cache: SlotList) -> Tensor:  # type: ignore[override]
        buffer, new_frames = self.input_buffer(x, cache)
        new_frames.copy_(x)
        return self.run_buffer(buffer, cache)


class RMSNorm(nn.Module):
    """L2-normalise over channels, times sqrt(dim) and a learnt per-channel gain.

    ``gamma`` keeps the reference's shape ((dim,1,1,1) for video, (dim,1,1) for
    images) so checkpoints load unchanged; it is broadcast over 5D input here.
    """

    def __init__(self, dim: int, images: bool) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones((dim, 1, 1) if images else (dim, 1, 1, 1)))

    def forward(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        # Half-precision input is normalised in fp32 (like the reference): the fp32 norm and
        # division happen inside the kernels and round once into ``out``; no fp32 copy of x.
        low_precision = x.dtype in (torch.float16, torch.bfloat16)
        norm = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32 if low_precision else None)
        if torch.is_grad_enabled() and (x.requires_grad or self.gamma.requires_grad):
            # Training (fv-rl): ``out=`` kernels record no autograd, so the same math out of place;
            # ``copy_`` into the conv's buffer is differentiable.
            gain = (self.gamma * self.scale).reshape(-1, *([1] * (x.dim() - 2)))
            normed = (x / norm.clamp_min(1e-12)).to(x.dtype) * gain.to(x.dtype)
            return normed if out is None else out.copy_(normed)
        if out is None:
            out = torch.empty_like(x)
        torch.div(x, norm.clamp_min_(1e-12), out=out)
        gain = (self.gamma * self.scale).to(out.dtype).reshape(-1, *([1] * (x.dim() - 2)))
        return out.mul_(gain)

    def silu_into(self, x: Tensor, out: Tensor | None, fused_ops: FusedOps = None) -> Tensor:
        """``silu(self(x))`` written into ``out`` (or a new tensor): one fused pass when ``fused_ops`` is given.

        Training (autograd recording) always takes the eager path: the fused kernels record no gradient.
        """
        if fused_ops is not None and not (torch.is_grad_enabled() and (x.requires_grad or self.gamma.requires_grad)):
            return fused_ops.channel_rms_norm_silu(x, self.gamma, self.scale, out=out)  # type: ignore[attr-defined]
        return F.silu(self(x, out=out), inplace=True)


def _frame_conv2d(x: Tensor, conv: nn.Conv2d, fused_ops: FusedOps = None) -> Tensor:
    """Apply a 2D conv to every frame of a 5D tensor without folding time into batch."""
    return _conv_with_bias(x, conv.weight.unsqueeze(2), conv.bias, (1, *conv.stride), (0, *conv.padding), fused_ops)


def _nearest_up2x(x: Tensor, channel_halves_are_frames: bool = False) -> Tensor:
    """2x nearest spatial upsampling of a 5D tensor in one strided copy (exact in any dtype).

    With ``channel_halves_are_frames`` the input is (b, 2c, t, h, w) whose channel
    half ``s`` is output frame ``2t + s``; that interleave is fused into the copy.
    """
    b, c, t, h, w = x.shape
    split = 2 if channel_halves_are_frames else 1
    c //= split
    source = x.view(b, split, c, t, h, w).permute(0, 2, 3, 1, 4, 5)  # (b, c, t, split, h, w)
    out = _empty_activation((b, c, t * split, 2 * h, 2 * w), x)
    out.view(b, c, t, split, h, 2, w, 2).copy_(
        source[:, :, :, :, :, None, :, None].expand(b, c, t, split, h, 2, w, 2)
    )
    return out


class ResidualBlock(nn.Module):
    """RMSNorm-SiLU-CausalConv twice, plus a (1x1x1 conv) shortcut.

    Each norm writes straight into its conv's padded input buffer, and conv1's buffer is
    freed before conv2's is allocated (the block's peak is its input, one buffer and one
    conv output). ``fused_ops`` (None: eager) fuses each norm with its SiLU.
    """

    def __init__(self, in_dim: int, out_dim: int, dropout: float, slots: SlotAllocator) -> None:
        super().__init__()
        self.fused_ops: FusedOps = None
        self.dropout_p = dropout
        self.norm1 = RMSNorm(in_dim, images=False)
        self.conv1 = CachedCausalConv3d(in_dim, out_dim, 3, padding=1, slots=slots)
        self.norm2 = RMSNorm(out_dim, images=False)
        self.conv2 = CachedCausalConv3d(out_dim, out_dim, 3, padding=1, slots=slots)
        self.conv_shortcut: nn.Module = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: Tensor, cache: SlotList) -> Tensor:
        shortcut = self.conv_shortcut(x)
        buffer, new_frames = self.conv1.input_buffer(x, cache)
        self.norm1.silu_into(x, new_frames, self.fused_ops)
        del new_frames
        h = self.conv1.run_buffer(buffer, cache)
        del buffer  # before conv2's buffer exists: the two never live together
        buffer, new_frames = self.conv2.input_buffer(h, cache)
        self.norm2.silu_into(h, new_frames, self.fused_ops)
        del h
        if self.dropout_p > 0 and self.training:
            new_frames.copy_(F.dropout(new_frames, self.dropout_p, training=True))
        del new_frames
        return self.conv2.run_buffer(buffer, cache).add_(shortcut)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (no mixing across time)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        tokens = self.norm(x).permute(0, 2, 3, 4, 1).reshape(b * t, 1, h * w, c)
        qkv = F.linear(tokens, self.to_qkv.weight.view(3 * c, c), self.to_qkv.bias)
        q, k, v = qkv.chunk(3, dim=-1)
        attended = F.scaled_dot_product_attention(q, k, v)
        out = F.linear(attended, self.proj.weight.view(c, c), self.proj.bias)
        return x + out.view(b, t, h, w, c).permute(0, 4, 1, 2, 3)


class Resample(nn.Module):
    """Spatial 2x up/down sampling, optionally with a causal 2x temporal step.

    ``resample.1`` is the frame-wise conv (index 0 was a parameter-free
    pad/upsample layer in the reference and is kept as a placeholder so the
    checkpoint key matches).
    """

    MODES = ("upsample2d", "upsample3d", "downsample2d", "downsample3d")

    def __init__(self, dim: int, mode: str, slots: SlotAllocator, upsample_out_dim: int | None = None) -> None:
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"Resample mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        self.upsample = mode.startswith("upsample")
        out_dim = (upsample_out_dim or dim // 2) if self.upsample else dim
        # Upsampling: same-size conv. Downsampling: stride 2 after a right/bottom pad of one.
        conv = nn.Conv2d(dim, out_dim, 3, padding=1) if self.upsample else nn.Conv2d(dim, dim, 3, stride=2)
        self.resample = nn.ModuleList([nn.Identity(), conv])
        #: The decoder's fused ops (``Decoder3d.set_fused_ops``): the frame conv's bias is then added by them.
        self.fused_ops: FusedOps = None
        self.time_slot: int | None = None
        if mode == "upsample3d":
            # Doubles channels; the two halves become two consecutive output frames.
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
            self.time_slot = slots.take()
        elif mode == "downsample3d":
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), padding=(0, 0, 0))
            self.time_slot = slots.take()

    def _upsample_time(self, x: Tensor, cache: SlotList) -> tuple[Tensor, bool]:
        """Causal 2x temporal step; returns the tensor and whether its channel halves are frames."""
        slot = self.time_slot
        assert slot is not None
        history = cache[slot]
        if history is None:
            # First chunk: the first latent frame maps to a single frame; mark the
            # stream as started with an empty history (= zero padding next time).
            cache[slot] = x.new_zeros((*x.shape[:2], 0, *x.shape[3:]))
            return x, False
        cache[slot] = _history_after(history, x)
        # (b, 2c, t): channel half s becomes output frame 2t + s (done inside the upsampling copy).
        return self.time_conv(x, history), True

    def _downsample_time(self, x: Tensor, cache: SlotList) -> Tensor:
        slot = self.time_slot
        assert slot is not None
        history = cache[slot]
        cache[slot] = x[:, :, -1:].clone()
        if history is None:
            # First chunk (a single frame) passes through without temporal striding.
            return x
        return self.time_conv(torch.cat([history[:, :, -1:].to(x.device), x], dim=2))

    def frame_conv(self, x: Tensor, conv: nn.Conv2d) -> Tensor:
        """The frame-wise 2D conv after upsampling (a parallel decode swaps in a halo-exchanging one)."""
        return _frame_conv2d(x, conv, self.fused_ops)

    def forward(self, x: Tensor, cache: SlotList) -> Tensor:
        conv = self.resample[1]
        assert isinstance(conv, nn.Conv2d)
        if self.upsample:
            halves_are_frames = False
            if self.mode == "upsample3d":
                x, halves_are_frames = self._upsample_time(x, cache)
            return self.frame_conv(_nearest_up2x(x, channel_halves_are_frames=halves_are_frames), conv)
        x = _frame_conv2d(F.pad(x, (0, 1, 0, 1)), conv)
        if self.mode == "downsample3d":
            x = self._downsample_time(x, cache)
        return x


class AvgDown3D(nn.Module):
    """Parameter-free 2.2 shortcut: space/time-to-channel, then mean over channel groups."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int) -> None:
        super().__init__()
        self.out_channels = out_channels
        self.factor_t = factor_t
        self.factor_s = factor_s
        factor = factor_t * factor_s * factor_s
        if (in_channels * factor) % out_channels:
            raise ValueError(
                f"AvgDown3D: in_channels*factor ({in_channels}*{factor}) must be divisible by out_channels ({out_channels})"
            )
        self.group = in_channels * factor // out_channels

    def forward(self, x: Tensor) -> Tensor:
        ft, fs = self.factor_t, self.factor_s
        front = (ft - x.shape[2] % ft) % ft
        if front:
            x = F.pad(x, (0, 0, 0, 0, front, 0))
        b, c, t, h, w = x.shape
        x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs)
        # channel order after folding: (c, ft, fs_h, fs_w)
        x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).reshape(b, self.out_channels, self.group, t // ft, h // fs, w // fs)
        return x.mean(dim=2)


class DupUp3D(nn.Module):
    """Parameter-free 2.2 shortcut: channel-to-space/time by duplication.

    Output channel ``o`` at sub-position ``k = (ti, hi, wi)`` reads input channel
    ``(o * factor + k) // repeats``. ``add_into`` adds that tensor to ``target``
    through a broadcast view when ``repeats`` tiles the sub-position grid, so the
    (large) duplicated tensor is never materialised.
    """

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.factor_t = factor_t
        self.factor_s = factor_s
        self.factor = factor_t * factor_s * factor_s
        if (out_channels * self.factor) % in_channels:
            raise ValueError(
                f"DupUp3D: out_channels*factor ({out_channels}*{self.factor}) must be divisible by in_channels ({in_channels})"
            )
        self.repeats = out_channels * self.factor // in_channels

    def materialize(self, x: Tensor, first_chunk: bool) -> Tensor:
        b, _, t, h, w = x.shape
        ft, fs = self.factor_t, self.factor_s
        dup = x.repeat_interleave(self.repeats, dim=1).view(b, self.out_channels, ft, fs, fs, t, h, w)
        out = dup.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, self.out_channels, t * ft, h * fs, w * fs)
        return out[:, :, ft - 1 :] if first_chunk else out

    def add_into(self, target: Tensor, x: Tensor, first_chunk: bool) -> Tensor:
        """``target += materialize(x, first_chunk)`` in place, one strided add per sub-position.

        Works for any memory layout and never builds the duplicated tensor.
        """
        b, _, t, h, w = x.shape
        ft, fs, r = self.factor_t, self.factor_s, self.repeats
        if self.factor % r:
            return target.add_(self.materialize(x, first_chunk))
        groups = self.factor // r
        grouped = x.view(b, self.out_channels, groups, t, h, w)  # input channel = o * groups + g
        drop = ft - 1 if first_chunk else 0  # the first chunk keeps only the last sub-frame(s)
        for k in range(self.factor):
            ti, hi, wi = k // (fs * fs), (k // fs) % fs, k % fs
            # output frame f = t_idx * ft + ti - drop, for f >= 0
            first_t = 0 if ti >= drop else 1
            start = first_t * ft + ti - drop
            if start >= target.shape[2]:
                continue
            target[:, :, start::ft, hi::fs, wi::fs].add_(grouped[:, :, k // r, first_t:])
        return target


class MidBlock(nn.Module):
    """Residual block, then (attention, residual block) pairs."""

    def __init__(self, dim: int, dropout: float, slots: SlotAllocator, num_layers: int = 1) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim, dropout, slots)])
        attentions = []
        for _ in range(num_layers):
            attentions.append(AttentionBlock(dim))
            self.resnets.append(ResidualBlock(dim, dim, dropout, slots))
        self.attentions = nn.ModuleList(attentions)

    def forward(self, x: Tensor, cache: SlotList) -> Tensor:
        x = self.resnets[0](x, cache)
        for attention, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet(attention(x), cache)
        return x


class ResidualDownBlock(nn.Module):
    """Wan 2.2 encoder stage: residual blocks + downsample, plus an AvgDown3D shortcut."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        dropout: float,
        num_res_blocks: int,
        temporal: bool,
        down: bool,
        slots: SlotAllocator,
    ) -> None:
        super().__init__()
        self.avg_shortcut = AvgDown3D(in_dim, out_dim, factor_t=2 if temporal else 1, factor_s=2 if down else 1)
        resnets = []
        for _ in range(num_res_blocks):
            resnets.append(ResidualBlock(in_dim, out_dim, dropout, slots))
            in_dim = out_dim
        self.resnets = nn.ModuleList(resnets)
        self.downsampler = (
            Resample(out_dim, "downsample3d" if temporal else "downsample2d", slots) if down else None
        )

    def forward(self, x: Tensor, cache: SlotList) -> Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h, cache)
        if self.downsampler is not None:
            h = self.downsampler(h, cache)
        return h.add_(self.avg_shortcut(x))


class UpBlock(nn.Module):
    """Wan 2.1 decoder stage: residual blocks, then an optional upsampler (halves channels)."""

    def __init__(
        self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, upsample_mode: str | None, slots: SlotAllocator
    ) -> None:
        super().__init__()
        resnets = []
        for _ in range(num_res_blocks + 1):
            resnets.append(ResidualBlock(in_dim, out_dim, dropout, slots))
            in_dim = out_dim
        self.resnets = nn.ModuleList(resnets)
        self.upsamplers = nn.ModuleList([Resample(out_dim, upsample_mode, slots)]) if upsample_mode else None

    def layers(self) -> list[nn.Module]:
        """The stage in order: residual blocks, then the upsampler (each called as ``layer(x, cache)``)."""
        return [*self.resnets, *(self.upsamplers or [])]

    def forward(self, x: Tensor, cache: SlotList, first_chunk: bool) -> Tensor:
        for layer in self.layers():
            x = layer(x, cache)
        return x


class ResidualUpBlock(nn.Module):
    """Wan 2.2 decoder stage: residual blocks + upsampler, plus a DupUp3D shortcut."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        num_res_blocks: int,
        dropout: float,
        temporal: bool,
        up: bool,
        slots: SlotAllocator,
    ) -> None:
        super().__init__()
        self.avg_shortcut = DupUp3D(in_dim, out_dim, factor_t=2 if temporal else 1, factor_s=2) if up else None
        resnets = []
        dim = in_dim
        for _ in range(num_res_blocks + 1):
            resnets.append(ResidualBlock(dim, out_dim, dropout, slots))
            dim = out_dim
        self.resnets = nn.ModuleList(resnets)
        self.upsampler = (
            Resample(out_dim, "upsample3d" if temporal else "upsample2d", slots, upsample_out_dim=out_dim)
            if up
            else None
        )

    def forward(self, x: Tensor, cache: SlotList, first_chunk: bool) -> Tensor:
        h = x
        for resnet in self.resnets:
            h = resnet(h, cache)
        if self.upsampler is not None:
            h = self.upsampler(h, cache)
        if self.avg_shortcut is not None:
            h = self.avg_shortcut.add_into(h, x, first_chunk)
        return h


class Encoder3d(nn.Module):
    """Causal video encoder: video (or patchified video) -> 2*z_dim channels."""

    def __init__(
        self,
        in_channels: int,
        dim: int,
        z_dim: int,
        dim_mult: tuple[int, ...],
        num_res_blocks: int,
        attn_scales: tuple[float, ...],
        temperal_downsample: tuple[bool, ...],
        dropout: float,
        is_residual: bool,
        slots: SlotAllocator,
    ) -> None:
        super().__init__()
        dims = [dim * m for m in (1, *dim_mult)]
        last = len(dim_mult) - 1
        self.conv_in = CachedCausalConv3d(in_channels, dims[0], 3, padding=1, slots=slots)
        self.down_blocks = nn.ModuleList()
        scale = 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if is_residual:
                temporal = temperal_downsample[i] if i != last else False
                self.down_blocks.append(
                    ResidualDownBlock(in_dim, out_dim, dropout, num_res_blocks, temporal, i != last, slots)
                )
                continue
            for _ in range(num_res_blocks):
                self.down_blocks.append(ResidualBlock(in_dim, out_dim, dropout, slots))
                if scale in attn_scales:
                    self.down_blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i != last:
                mode = "downsample3d" if temperal_downsample[i] else "downsample2d"
                self.down_blocks.append(Resample(out_dim, mode, slots))
                scale /= 2.0
        self.mid_block = MidBlock(dims[-1], dropout, slots)
        self.norm_out = RMSNorm(dims[-1], images=False)
        self.conv_out = CachedCausalConv3d(dims[-1], z_dim, 3, padding=1, slots=slots)

    def forward(self, x: Tensor, cache: SlotList) -> Tensor:
        x = self.conv_in(x, cache)
        for layer in self.down_blocks:
            x = layer(x) if isinstance(layer, AttentionBlock) else layer(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x), inplace=True), cache)


@dataclass(frozen=True)
class EdgeCrop:
    """Pixels to drop from each spatial edge of an activation (a halo-tiled decode's margins)."""

    top: int = 0
    bottom: int = 0
    left: int = 0
    right: int = 0


def _crop_edges(x: Tensor, crops: Sequence[EdgeCrop] | None, index: int) -> Tensor:
    """``x`` without ``crops[index]``'s edges, as a view: the layers after a crop read their input through its
    strides (the norms, the nearest upsampling) or write it into fresh buffers, so no cropped copy is made."""
    if crops is None:
        return x
    crop = crops[index]
    if crop == EdgeCrop():
        return x
    h, w = x.shape[-2:]
    return x[..., crop.top : h - crop.bottom, crop.left : w - crop.right]


def _spatial_radius(conv: nn.Module) -> int:
    """How many pixels on each side a conv reads (its padding; the causal convs pad space symmetrically)."""
    if isinstance(conv, nn.Identity):
        return 0
    assert isinstance(conv, CausalConv3d)
    _, pad_h, pad_w = conv.spatial_padding
    return max(pad_h, pad_w)


def _upsamples_time(stage: nn.Module) -> bool:
    if isinstance(stage, UpBlock):
        return stage.upsamplers is not None and stage.upsamplers[0].mode == "upsample3d"
    return isinstance(stage, ResidualUpBlock) and stage.upsampler is not None and stage.upsampler.mode == "upsample3d"


class Decoder3d(nn.Module):
    """Causal video decoder: z_dim channels -> video (or patchified video)."""

    def __init__(
        self,
        dim: int,
        z_dim: int,
        dim_mult: tuple[int, ...],
        num_res_blocks: int,
        temperal_upsample: tuple[bool, ...],
        dropout: float,
        out_channels: int,
        is_residual: bool,
        slots: SlotAllocator,
    ) -> None:
        super().__init__()
        dims = [dim * m for m in (dim_mult[-1], *dim_mult[::-1])]
        last = len(dim_mult) - 1
        self.conv_in = CachedCausalConv3d(z_dim, dims[0], 3, padding=1, slots=slots)
        self.mid_block = MidBlock(dims[0], dropout, slots)
        self.up_blocks = nn.ModuleList()
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            up = i != last
            temporal = up and temperal_upsample[i]
            if is_residual:
                self.up_blocks.append(ResidualUpBlock(in_dim, out_dim, num_res_blocks, dropout, temporal, up, slots))
            else:
                # 2.1 upsamplers halve the channels, so later stages take in_dim // 2.
                mode = ("upsample3d" if temporal else "upsample2d") if up else None
                stage_in = in_dim // 2 if i > 0 else in_dim
                self.up_blocks.append(UpBlock(stage_in, out_dim, num_res_blocks, dropout, mode, slots))
        self.norm_out = RMSNorm(dims[-1], images=False)
        self.conv_out = CachedCausalConv3d(dims[-1], out_channels, 3, padding=1, slots=slots)
        self.fused_ops: FusedOps = None
        #: Run the stages after the last temporal upsampler on this many frames at a time (None: all).
        self.frame_chunk: int | None = None
        temporal = [i for i, block in enumerate(self.up_blocks) if _upsamples_time(block)]
        #: Index of the first stage that only works frame by frame (causal convs with history,
        #: spatial upsampling): chunking from there on is exact.
        self.framewise_from = temporal[-1] + 1 if temporal else 0

    def set_fused_ops(self, fused_ops: FusedOps) -> None:
        """Fuse every norm + SiLU of the decoder (a ``FusedOps`` with ``channel_rms_norm_silu``), and on CUDA add
        its convs' biases through ``channel_bias_add_``; None: eager."""
        self.fused_ops = fused_ops
        for module in self.modules():
            if isinstance(module, (ResidualBlock, CausalConv3d, Resample)):
                module.fused_ops = fused_ops

    def set_frame_chunk(self, frames: int | None) -> None:
        """Decode the full-resolution stages ``frames`` frames at a time (None: a step's frames at once).

        Exact: those stages are causal in time with their history in the cache, so chunked
        processing computes the same convolutions; only the live activations shrink.
        """
        if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
            raise ValueError(f"frame_chunk must be a positive int or None, got {frames!r}")
        self.frame_chunk = frames

    def forward(self, x: Tensor, cache: SlotList, first_chunk: bool) -> Tensor:
        return self.upper(self.lower(x, cache), cache, first_chunk)

    def lower(self, x: Tensor, cache: SlotList) -> Tensor:
        """The input conv and the mid block: the decoder's only layers that mix a frame's pixels
        globally (the mid block's attention). Everything after them (:meth:`upper`) is local in space."""
        return self.mid_block(self.conv_in(x, cache), cache)

    def upper(self, x: Tensor, cache: SlotList, first_chunk: bool, crops: Sequence[EdgeCrop] | None = None) -> Tensor:
        """The up stages and the output conv on :meth:`lower`'s output.

        ``crops`` (one per boundary of :meth:`halo_geometry`, then one for the output) trims the
        spatial edges before each stage, before the output conv and from the output: a halo-tiled
        decode (``WanVAE.decode(halo=...)``) runs a tile with a margin and drops the margin as soon
        as no later layer reads it.
        """
        for index, up_block in enumerate(self.up_blocks):
            if index == self.framewise_from and self.frame_chunk is not None and x.shape[2] > self.frame_chunk:
                return self._framewise_chunked(x, cache, first_chunk, crops)
            x = _crop_edges(x, crops, index)
            for step in self._stage_steps(up_block, cache, first_chunk):
                x = step(x)
        buffer = self._output_buffer(x, cache, crops)
        del x  # only conv_out's padded input lives through conv_out
        return self._conv_out(buffer, cache, crops)

    def _conv_out(self, buffer: Tensor, cache: SlotList, crops: Sequence[EdgeCrop] | None) -> Tensor:
        """The output conv over its filled input buffer, the output's crop dropped."""
        return _crop_edges(self.conv_out.run_buffer(buffer, cache), crops, len(self.up_blocks) + 1)

    def _framewise_chunked(
        self, x: Tensor, cache: SlotList, first_chunk: bool, crops: Sequence[EdgeCrop] | None = None
    ) -> Tensor:
        """The frame-wise stages and the output conv over ``frame_chunk`` frames at a time."""
        assert self.frame_chunk is not None
        out: Tensor | None = None
        start = 0
        for chunk in x.split(self.frame_chunk, dim=2):
            y = chunk
            for index in range(self.framewise_from, len(self.up_blocks)):
                y = _crop_edges(y, crops, index)
                for step in self._stage_steps(self.up_blocks[index], cache, first_chunk):
                    y = step(y)
            buffer = self._output_buffer(y, cache, crops)
            del y
            y = self._conv_out(buffer, cache, crops)
            del buffer
            if out is None:  # the output has few channels: one small buffer for the step
                out = _empty_activation((y.shape[0], y.shape[1], x.shape[2], *y.shape[3:]), y)
            out[:, :, start : start + y.shape[2]].copy_(y)
            start += y.shape[2]
        assert out is not None
        return out

    def halo_geometry(self) -> tuple[list[int], list[int]]:
        """(scale, reach) at each boundary of :meth:`upper`: before each up stage, then before the output conv.

        ``scale`` is that boundary's pixels per latent pixel; ``reach`` how many of its pixels on each
        side an output pixel depends on, through every later layer (rounded up at each upsampler).
        A tile that carries ``reach`` pixels of margin at a boundary computes its own output exactly.
        """
        reach = _spatial_radius(self.conv_out)
        reaches, factors = [reach], []
        for stage in reversed(self.up_blocks):
            resnets, upsampler = (
                (stage.resnets, stage.upsamplers[0] if stage.upsamplers is not None else None)
                if isinstance(stage, UpBlock) else (stage.resnets, stage.upsampler)
            )
            if upsampler is not None:
                if not upsampler.upsample:
                    raise ValueError("halo_geometry: a decoder stage downsamples")
                conv = upsampler.resample[1]
                assert isinstance(conv, nn.Conv2d)
                # The frame conv runs at twice the resolution; nearest upsampling halves the reach (rounded up).
                reach = -(-(reach + max(conv.padding)) // 2)
            for resnet in resnets:
                reach += _spatial_radius(resnet.conv1) + _spatial_radius(resnet.conv2)
            reaches.append(reach)
            factors.append(2 if upsampler is not None else 1)
        reaches.reverse()
        scales = [1]
        for factor in reversed(factors):
            scales.append(scales[-1] * factor)
        return scales, reaches

    @staticmethod
    def _stage_steps(stage: nn.Module, cache: SlotList, first_chunk: bool) -> list[Callable[[Tensor], Tensor]]:
        """A stage as the steps its caller runs, ``x = step(x)``: a 2.1 stage layer by layer, so no
        frame but the caller's holds the stage's input while later layers run; a 2.2 stage whole
        (it keeps its input for the shortcut anyway)."""
        if isinstance(stage, UpBlock):
            return [functools.partial(layer, cache=cache) for layer in stage.layers()]
        return [functools.partial(stage, cache=cache, first_chunk=first_chunk)]

    def _output_buffer(self, x: Tensor, cache: SlotList, crops: Sequence[EdgeCrop] | None = None) -> Tensor:
        """conv_out's padded input with the output norm + SiLU of ``x`` (its crop dropped) written straight into it."""
        x = _crop_edges(x, crops, len(self.up_blocks))
        buffer, new_frames = self.conv_out.input_buffer(x, cache)
        self.norm_out.silu_into(x, new_frames, self.fused_ops)
        return buffer
