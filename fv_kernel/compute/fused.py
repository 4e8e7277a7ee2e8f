"""Fused elementwise kernels for DiT blocks: one pass over the activations instead of many.

A DiT block at video sizes is dominated by matmuls and attention, but eager PyTorch
also spends real time on the elementwise glue between them: every ``x.float()``,
``* (1 + scale)``, ``+ shift``, ``.to(bf16)`` is a full read and write of a
(tokens x width) tensor. The kernels here do each piece of glue in one pass, reading
each input once and writing each output once, with the statistics in fp32.

Two implementations of one interface, :class:`FusedOps`:

- :class:`TorchFusedOps`: the reference, plain torch with the eager model's formulas
  (bit-identical to the unfused eager code, runs anywhere);
- :class:`TritonFusedOps`: Triton kernels (CUDA; or Triton's CPU interpreter under
  ``TRITON_INTERPRET=1``, which is how they are checked without a GPU).

:func:`select_fused_ops` picks Triton only on CUDA with Triton importable.

Predicted gains are for Wan2.1-1.3B at 480x832x81 (32,760 tokens x 1536, bf16) on an
H200 (4.8 TB/s datasheet, about 4 TB/s achievable), counted as bytes moved per element.
"""

from __future__ import annotations

import abc
import os
from typing import ClassVar

import torch
import torch.nn.functional as F

from fv_kernel.compute.fp8 import QuantizedRows, takes_quantized_rows
from fv_kernel.compute.triton_support import triton_available

__all__ = [
    "FusedOps",
    "TorchFusedOps",
    "TritonFusedOps",
    "FusedOpsUnavailable",
    "triton_available",
    "select_fused_ops",
]


class FusedOpsUnavailable(RuntimeError):
    """The requested fused-op implementation cannot run here (no Triton, no CUDA)."""


def _broadcast_rows(mod: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (B, S, D) modulation tensor (S = 1 or tokens) viewed as ``like``'s (B, L, D) without copying."""
    if mod.dim() != 3 or mod.shape[-1] != like.shape[-1]:
        raise ValueError(f"modulation tensor must be (B, S, {like.shape[-1]}), got {tuple(mod.shape)}")
    return mod.expand(like.shape)


class FusedOps(abc.ABC):
    """The fused glue ops of a modulated DiT block. Inputs are (B, L, D) token tensors.

    ``scale``/``shift``/``gate`` are fp32 (B, S, D) with S = 1 (one timestep per sample) or
    S = L (per-token timesteps). Every op returns tensors in ``x``'s dtype.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def modulated_layer_norm(
        self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``(layer_norm(x.float()) * (1 + scale) + shift).to(x.dtype)``, no affine, fp32 statistics.

        Predicted gain: eager makes 5 passes (upcast, norm, scale, shift, downcast), about
        36 bytes per element; fused reads 2 and writes 2. At 32,760 x 1536 that is about
        0.40 ms -> 0.05 ms per call; with two calls per block (norm1, norm3) and 30 blocks,
        about 20 ms per 1.3B forward.
        """

    @abc.abstractmethod
    def residual_layer_norm(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        gate: torch.Tensor | None,
        eps: float,
        *,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add then LayerNorm, returning ``(x_new, normed)``.

        ``x_new = (x.float() + y.float() * gate).to(x.dtype)`` (or ``x + y`` without a gate);
        ``normed = layer_norm(x_new.float()) [* weight + bias] [* (1 + scale) + shift]``, cast to x.dtype.

        Predicted gain: eager reads the fresh residual back for the norm and runs about
        8 passes (about 56 bytes per element); fused reads x and y once and writes both
        outputs (8 bytes). About 0.6 ms -> 0.09 ms per call, two calls per block
        (gated residual + norm2, residual + modulated norm3): about 30 ms per 1.3B forward.
        """

    @abc.abstractmethod
    def gated_residual(self, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``(x.float() + y.float() * gate).to(x.dtype)``.

        Predicted gain: eager upcasts, multiplies, adds and downcasts (about 34 bytes per
        element); fused reads 4 and writes 2. About 0.35 ms -> 0.07 ms per call, once per
        block after the FFN: about 8 ms per 1.3B forward.
        """

    @abc.abstractmethod
    def qk_rms_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        heads: int,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """RMSNorm across all heads (with ``weight``) then interleaved-pair RoPE; (B, L, H*D) -> (B, L, H, D).

        ``rotary`` = (cos, sin), each (L, 1, D/2) fp32, rotating pairs (x[2i], x[2i+1]);
        None skips the rotation (cross-attention queries/keys).

        Predicted gain: eager RMSNorm plus RoPE (unbind, four products, two sums, two casts,
        stack) is about 60 bytes per element; fused reads 2 and writes 2. For q and k of the
        self-attention: about 1.3 ms -> 0.1 ms per block, about 35 ms per 1.3B forward.
        """

    @abc.abstractmethod
    def channel_rms_norm_silu(
        self, x: torch.Tensor, gamma: torch.Tensor, scale: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``silu(x / max(||x||_2 over dim 1, 1e-12) * (gamma * scale))`` for a (B, C, T, H, W) video tensor.

        The channel RMS norm of a causal video VAE (L2 over channels times ``scale`` = sqrt(C)
        and a per-channel ``gamma`` of C elements, no bias), then SiLU. The norm is taken in
        fp32; the quotient, the gain product and the SiLU each round to ``x.dtype`` as the
        eager three-pass code does. ``out`` (same shape and dtype, any strides: a view into a
        conv's padded input buffer) receives the result, else a new tensor does.

        Predicted gain: eager reads x twice (norm, divide) and makes two more read-write
        passes (gain, SiLU) over the output, about 14 bytes per bf16 element; fused reads 2
        and writes 2. The Wan 2.1 decode of 81 frames runs this on about 3.4e10 elements
        (norm1 and norm2 of its 14 residual blocks, and norm_out, over 21 latent steps): by
        bytes alone at about 4 TB/s, 115 ms -> 33 ms. The measured eager share was larger
        (about 40% of a 1,229 ms decode): eager's strided channel reduction and broadcasts run
        well below bandwidth. The fused time is not measured yet.
        """

    def channel_bias_add_(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x += bias`` per channel (dim 1) of a (B, C, ...) tensor, in place; returns ``x``.

        A convolution given its bias runs as a bias-free cuDNN convolution and a broadcast add, and
        on channels-last video activations PyTorch's broadcast add is a strided kernel: on an H100
        it moved a (96, 4, 480, 832) bf16 tensor in 470 µs, about 1.3 TB/s, and the Wan 2.1 VAE
        decode of 81 frames spent 107 of its 1,044 ms there (docs/benchmarks.md). The default is
        that add (the reference); the Triton one walks the memory in order. Its gain is not
        measured yet.
        """
        return x.add_(bias.to(x.dtype).reshape(-1, *([1] * (x.dim() - 2))))

    # -- the same ops feeding fp8_dynamic linears (docs/precision.md, "The activation quantization")

    def takes_quantized_rows(self, *consumers: torch.nn.Module) -> bool:
        """Whether an input read only by ``consumers`` should come from a ``*_fp8`` op: each consumer is an
        ``fp8_dynamic`` :class:`~fv_kernel.compute.fp8.Fp8Linear`, which would quantize it anyway. A model
        asks this per site, so a site with any other consumer keeps its activation-dtype input."""
        return takes_quantized_rows(*consumers)

    def modulated_layer_norm_fp8(
        self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
    ) -> QuantizedRows:
        """:meth:`modulated_layer_norm`'s rows quantized per token to e4m3, for ``fp8_dynamic`` linears.

        Each row is rounded to ``x.dtype`` first and then quantized (scale = row absmax / 448), as the
        linear would quantize :meth:`modulated_layer_norm`'s output: the same e4m3 rows and scales. The
        default composes the two; a fused kernel never writes the ``x.dtype`` rows (at 32,760 x 1536 bf16,
        100 MB written and read back per call).
        """
        return QuantizedRows.quantize(self.modulated_layer_norm(x, scale, shift, eps))

    def residual_layer_norm_fp8(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        gate: torch.Tensor | None,
        eps: float,
        *,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, QuantizedRows]:
        """:meth:`residual_layer_norm` with its ``normed`` output quantized as in :meth:`modulated_layer_norm_fp8`."""
        x_new, normed = self.residual_layer_norm(x, y, gate, eps, weight=weight, bias=bias, scale=scale, shift=shift)
        return x_new, QuantizedRows.quantize(normed)

    def gelu_tanh_fp8(self, h: torch.Tensor) -> QuantizedRows:
        """``F.gelu(h, approximate="tanh")`` rounded to ``h.dtype``, then quantized per token to e4m3.

        The FFN's second linear takes the GELU's output; fused, the (tokens x ffn_dim) activation is
        read once and written once in e4m3 (at Wan-1.3B's 32,760 x 8960, bf16: 587 MB read, 294 MB
        written, instead of the GELU's read and write and the quantization's two reads).
        """
        return QuantizedRows.quantize(F.gelu(h, approximate="tanh"))


class TorchFusedOps(FusedOps):
    """The reference: exactly the eager model's formulas (bitwise equal to the unfused code)."""

    name: ClassVar[str] = "torch"

    def modulated_layer_norm(
        self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
    ) -> torch.Tensor:
        normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
        return (normed * (1 + scale) + shift).type_as(x)

    def residual_layer_norm(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        gate: torch.Tensor | None,
        eps: float,
        *,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x_new = self.gated_residual(x, y, gate) if gate is not None else x + y
        normed = F.layer_norm(
            x_new.float(), (x.shape[-1],),
            None if weight is None else weight.float(), None if bias is None else bias.float(), eps,
        )  # fmt: skip
        if scale is not None or shift is not None:
            if scale is None or shift is None:
                raise ValueError("scale and shift must be given together")
            normed = normed * (1 + scale) + shift
        return x_new, normed.type_as(x)

    def gated_residual(self, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (x.float() + y * gate).type_as(x)

    def qk_rms_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        heads: int,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        normed = F.rms_norm(x, (x.shape[-1],), weight, eps).unflatten(-1, (heads, -1))
        if rotary is None:
            return normed
        cos, sin = rotary
        even, odd = normed.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack(
            ((even * cos - odd * sin).to(normed.dtype), (even * sin + odd * cos).to(normed.dtype)), dim=-1
        )
        return rotated.flatten(-2)

    def channel_rms_norm_silu(
        self, x: torch.Tensor, gamma: torch.Tensor, scale: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check_video(x, gamma, out)
        low_precision = x.dtype in (torch.float16, torch.bfloat16)
        norm = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32 if low_precision else None)
        out = torch.empty_like(x) if out is None else out
        torch.div(x, norm.clamp_min_(1e-12), out=out)
        out.mul_((gamma * scale).to(out.dtype).reshape(-1, 1, 1, 1))
        return F.silu(out, inplace=True)


def _check_video(x: torch.Tensor, gamma: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 5:
        raise ValueError(f"channel_rms_norm_silu: x must be a (B, C, T, H, W) video tensor, got shape {tuple(x.shape)}")
    if gamma.numel() != x.shape[1]:
        raise ValueError(f"channel_rms_norm_silu: gamma has {gamma.numel()} elements, x has {x.shape[1]} channels")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(
            f"channel_rms_norm_silu: out must match x (shape {tuple(x.shape)}, {x.dtype}); "
            f"got {tuple(out.shape)}, {out.dtype}"
        )


def _row_block(width: int) -> int:
    return max(16, 1 << (width - 1).bit_length())


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _build_kernels() -> tuple[object, object, object, object]:
    """The Triton kernels, imported on first use (Triton is optional); decorated when first imported,
    so under Triton's interpreter when ``TRITON_INTERPRET=1`` was set before."""
    from fv_kernel.compute import fused_kernels as k

    return k.residual_norm_kernel, k.rms_rope_kernel, k.channel_rms_silu_kernel, k.channel_bias_kernel


class TritonFusedOps(FusedOps):
    """Triton kernels, one program per token row (widths up to 16k fit one block)."""

    name: ClassVar[str] = "triton"

    def __init__(self) -> None:
        if not triton_available():
            raise FusedOpsUnavailable("fused_ops='triton' needs the triton package, which is not importable")
        self._residual_norm, self._rms_rope, self._channel_rms_silu, self._channel_bias = _build_kernels()
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        #: Built under ``TRITON_INTERPRET=1`` (Triton decides when the kernels are decorated, at the
        #: first import of ``fused_kernels``): the kernels then run in Triton's interpreter and take CPU tensors.
        self.interpreted = isinstance(self._residual_norm, InterpretedFunction)
        interpret_asked = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if (self.interpreted and not isinstance(tl.sum, InterpretedFunction)) or (interpret_asked and not self.interpreted):
            # Triton's own jit helpers (tl.sum) were decorated when triton.language was first
            # imported; without the interpreter then, interpreted kernels fail when they call them.
            raise FusedOpsUnavailable(
                "TRITON_INTERPRET=1 was set after triton.language had been imported without it (torch and "
                "diffusers import it): set it in the environment before the process imports triton"
            )

    def _require_device(self, x: torch.Tensor) -> None:
        if x.device.type != "cuda" and not self.interpreted:
            raise FusedOpsUnavailable(
                f"TritonFusedOps got a {x.device.type} tensor: the kernels run on CUDA, or on CPU only when "
                "built under Triton's interpreter (TRITON_INTERPRET=1 set before TritonFusedOps() is created)"
            )

    def _rows(self, x: torch.Tensor) -> tuple[int, int, int]:
        if x.dim() != 3:
            raise ValueError(f"expected a (B, L, D) token tensor, got shape {tuple(x.shape)}")
        self._require_device(x)
        batch, tokens, width = x.shape
        return batch, tokens, width

    def _launch_residual_norm(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None,
        gate: torch.Tensor | None,
        eps: float,
        *,
        norm: bool,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
        quantize: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | QuantizedRows]:
        batch, tokens, width = self._rows(x)
        x = x.contiguous()
        y = y.contiguous() if y is not None else None
        x_out = torch.empty_like(x) if y is not None else x
        out = torch.empty_like(x) if norm and not quantize else x_out
        if quantize:
            q = torch.empty(batch * tokens, width, dtype=torch.float8_e4m3fn, device=x.device)
            q_scale = torch.empty(batch * tokens, 1, dtype=torch.float32, device=x.device)
        if (scale is None) != (shift is None):
            raise ValueError("scale and shift must be given together")
        gate_b = _broadcast_rows(gate, x) if gate is not None else None
        scale_b = _broadcast_rows(scale, x) if scale is not None else None
        shift_b = _broadcast_rows(shift, x) if shift is not None else None
        for label, t in (("gate", gate_b), ("scale", scale_b), ("shift", shift_b)):
            if t is not None and (t.stride(-1) != 1 or t.dtype != torch.float32):
                raise ValueError(f"{label} must be fp32 with unit stride on the last dim")
        if (weight is None) != (bias is None):
            raise ValueError("weight and bias must be given together")
        block = _row_block(width)
        self._residual_norm[(batch * tokens,)](  # type: ignore[index]
            x, y if y is not None else x, x_out, out,
            gate_b if gate_b is not None else x, scale_b if scale_b is not None else x,
            shift_b if shift_b is not None else x,
            weight.contiguous() if weight is not None else x, bias.contiguous() if bias is not None else x,
            q if quantize else x, q_scale if quantize else x,
            tokens, width, eps,
            gate_b.stride(0) if gate_b is not None else 0, gate_b.stride(1) if gate_b is not None else 0,
            scale_b.stride(0) if scale_b is not None else 0, scale_b.stride(1) if scale_b is not None else 0,
            shift_b.stride(0) if shift_b is not None else 0, shift_b.stride(1) if shift_b is not None else 0,
            HAS_RESIDUAL=y is not None, HAS_GATE=gate is not None, HAS_NORM=norm,
            HAS_AFFINE=weight is not None, HAS_MOD=scale is not None, QUANTIZE=quantize, EMULATE=self.interpreted,
            BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
        if quantize:
            return x_out, QuantizedRows(q, q_scale, x.shape, x.dtype)
        return x_out, out

    def modulated_layer_norm(
        self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self._launch_residual_norm(x, None, None, eps, norm=True, scale=scale, shift=shift)[1]

    def residual_layer_norm(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        gate: torch.Tensor | None,
        eps: float,
        *,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._launch_residual_norm(
            x, y, gate, eps, norm=True, weight=weight, bias=bias, scale=scale, shift=shift
        )

    def gated_residual(self, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._launch_residual_norm(x, y, gate, 0.0, norm=False)[0]

    def modulated_layer_norm_fp8(
        self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
    ) -> QuantizedRows:
        return self._launch_residual_norm(x, None, None, eps, norm=True, scale=scale, shift=shift, quantize=True)[1]

    def residual_layer_norm_fp8(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        gate: torch.Tensor | None,
        eps: float,
        *,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, QuantizedRows]:
        return self._launch_residual_norm(
            x, y, gate, eps, norm=True, weight=weight, bias=bias, scale=scale, shift=shift, quantize=True
        )

    def gelu_tanh_fp8(self, h: torch.Tensor) -> QuantizedRows:
        self._require_device(h)
        from fv_kernel.compute.fp8_triton import fp8_gelu_quantize_rows  # the row quantization, a GELU prologue

        q, q_scale = fp8_gelu_quantize_rows(h.contiguous().reshape(-1, h.shape[-1]))
        return QuantizedRows(q, q_scale, h.shape, h.dtype)

    def qk_rms_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        heads: int,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        batch, tokens, width = self._rows(x)
        if width % (2 * heads):
            raise ValueError(f"width {width} is not heads ({heads}) x an even head_dim")
        half_head = width // heads // 2
        x = x.contiguous()
        out = torch.empty_like(x)
        if rotary is not None:
            cos, sin = (t.float().reshape(tokens, half_head).contiguous() for t in rotary)
        else:
            cos = sin = x
        block = _row_block(width // 2)
        self._rms_rope[(batch * tokens,)](  # type: ignore[index]
            x, out, weight.contiguous(), cos, sin, tokens, width, half_head, eps,
            HAS_ROPE=rotary is not None, BLOCK_PAIRS=block, num_warps=_warps(block),
        )  # fmt: skip
        return out.unflatten(-1, (heads, -1))

    def channel_rms_norm_silu(
        self, x: torch.Tensor, gamma: torch.Tensor, scale: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        _check_video(x, gamma, out)
        self._require_device(x)
        if out is None:
            out = torch.empty_like(x)  # keeps x's memory format (channels-last stays channels-last)
        batch, channels, frames, height, width = x.shape
        voxels = batch * frames * height * width
        gain = (gamma * scale).to(x.dtype).reshape(-1).contiguous()  # rounded as the eager gain is
        block_c = _row_block(channels)
        block_v = max(1, 4096 // block_c)
        self._channel_rms_silu[(_cdiv(voxels, block_v),)](  # type: ignore[index]
            x, out, gain, voxels, channels, frames, height, width, *x.stride(), *out.stride(),
            BLOCK_V=block_v, BLOCK_C=block_c, num_warps=4,
        )  # fmt: skip
        return out

    def channel_bias_add_(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3 or bias.numel() != x.shape[1]:
            raise ValueError(f"bias must hold one value per channel of a (B, C, ...) tensor: x {tuple(x.shape)}, "
                             f"bias {tuple(bias.shape)}")
        self._require_device(x)
        if x.numel() == 0:
            return x
        channels = x.shape[1]
        if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and channels > 1:
            channels_last, inner = True, 1
        elif x.is_contiguous():
            channels_last, inner = False, x[0, 0].numel()
        else:
            return super().channel_bias_add_(x, bias)  # another layout: the reference's strided add
        block = 4096
        self._channel_bias[(_cdiv(x.numel(), block),)](  # type: ignore[index]
            x, bias.to(x.dtype).contiguous(), x.numel(), channels, inner,
            CHANNELS_LAST=channels_last, BLOCK=block, num_warps=8,
        )  # fmt: skip
        return x


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def select_fused_ops(device: torch.device | str, mode: str = "auto") -> FusedOps | None:
    """The fused-op implementation for ``mode``: ``off`` (None: the model's eager code),
    ``torch`` (reference), ``triton``, or ``auto`` (Triton on CUDA when importable, else None).
    """
    device = torch.device(device)
    if mode == "off":
        return None
    if mode == "torch":
        return TorchFusedOps()
    if mode == "triton":
        if device.type != "cuda":
            raise FusedOpsUnavailable(f"fused_ops='triton' needs a CUDA device, got {device}")
        return TritonFusedOps()
    if mode == "auto":
        return TritonFusedOps() if device.type == "cuda" and triton_available() else None
    raise ValueError(f"fused_ops must be one of 'off', 'auto', 'torch', 'triton'; got {mode!r}")
