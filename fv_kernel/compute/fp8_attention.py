"""The ``fp8`` attention driver: Q, K, P and V in e4m3, fp32 accumulation (docs/precision.md).

The quantization (FlashAttention-3 FP8 / SageAttention2 style, without the Hadamard rotation):

- Q: one scale per query row (absmax / 448);
- K: smoothed first (its mean over tokens subtracted, per head: every score of a query row moves
  by the same amount, which softmax ignores), then one scale per :data:`K_BLOCK` keys;
- P (the unnormalized softmax, in [0, 1]): the fixed scale 1/448; the row sums stay in fp32;
- V: one scale per channel of a head (absmax over tokens).

K's mean and V's channel scales come from :func:`kv_statistics` (two reductions in torch); both
implementations start from them. Two implementations of that one computation: the Triton kernels
(:func:`fp8_attention_triton`: one pass quantizing K and V, then online softmax; CUDA) and
:func:`fp8_attention_torch` (quantize, dequantize, then attention in fp32: any device, the
reference). ``implementation="auto"`` takes Triton on CUDA when it is importable, else torch.

Parity contract of the driver (tested, tests/test_compute_fp8_attention.py): on unit-normal q/k/v the
output's relative error (Frobenius) against fp32 SDPA is below :data:`PARITY_REL_ERROR`, and the
Triton kernel is within :data:`KERNEL_REL_ERROR` of the torch reference (they differ only in where
P is rounded: the kernel rounds it against the running row maximum, the reference against the
final one). Masks and ``is_causal`` are not supported (video DiTs use neither): such a call raises
:class:`~fv_kernel.compute.attention_backends.AttentionBackendUnavailable`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from fv_kernel.compute.attention import AttentionBackend
from fv_kernel.compute.attention_backends import AttentionBackendUnavailable
from fv_kernel.compute.fp8 import E4M3_MAX, Fp8Error

__all__ = [
    "KERNEL_REL_ERROR",
    "K_BLOCK",
    "PARITY_REL_ERROR",
    "Fp8Attention",
    "fp8_attention_torch",
    "fp8_attention_triton",
    "kv_statistics",
    "quantize_blocks",
    "quantize_kv",
]

#: Keys sharing one K scale (the Triton kernel's key tiles divide it).
K_BLOCK = 128
#: The driver's parity bound: relative Frobenius error against fp32 SDPA on unit-normal inputs.
PARITY_REL_ERROR = 0.07
#: The Triton kernel against :func:`fp8_attention_torch`, same inputs.
KERNEL_REL_ERROR = 0.03
_MIN_SCALE = 1e-12


def quantize_blocks(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [BH, L, D]`` as e4m3 with one fp32 scale per ``block`` consecutive tokens: ``(q, scale [BH, ceil(L/block)])``."""
    bh, length, dim = t.shape
    blocks = -(-length // block)
    padded = torch.nn.functional.pad(t.float(), (0, 0, 0, blocks * block - length)).reshape(bh, blocks, block * dim)
    scale = (padded.abs().amax(-1) / E4M3_MAX).clamp(min=_MIN_SCALE)
    q = (padded / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(bh, blocks * block, dim)[:, :length], scale


def kv_statistics(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K's mean over tokens and V's per-channel scale (absmax over tokens / 448), fp32, for ``k``/``v``
    ``[..., L, D]`` (one pass over each; no fp32 copy of either)."""
    k_mean = k.mean(dim=-2, dtype=torch.float32)
    v_min, v_max = torch.aminmax(v, dim=-2)
    v_scale = (torch.maximum(v_max, -v_min).float() / E4M3_MAX).clamp(min=_MIN_SCALE)
    return k_mean, v_scale


def quantize_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K smoothed (mean over tokens subtracted) and quantized per :data:`K_BLOCK` keys; V per channel.

    ``k``/``v`` ``[BH, L, D]``. Returns ``(k_e4m3 [BH, L, D], k_scale [BH, blocks], v_e4m3 [BH, L, D],
    v_scale [BH, D])``: ``k - mean ≈ k_e4m3 · k_scale`` and ``v ≈ v_e4m3 · v_scale``.
    """
    k_mean, v_scale = kv_statistics(k, v)
    kq, k_scale = quantize_blocks(k.float() - k_mean[:, None, :], K_BLOCK)
    vq = (v.float() / v_scale[:, None, :]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return kq, k_scale, vq, v_scale


def _dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(block, dim=1)[:, : q.shape[1], None]


def fp8_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """The driver's computation in torch: quantize and dequantize Q, K, V (and P) as the kernel
    does, then attention in fp32. ``(B, H, L, D)`` tensors, ``k``/``v`` with ``q``'s heads; the
    output has ``q``'s dtype."""
    batch, heads, lq, dim = q.shape
    lk = k.shape[2]
    if lk == 0 and lq > 0:
        raise Fp8Error("fp8 attention needs at least one key (softmax over zero keys is undefined)")
    qq, q_scale = quantize_blocks(q.reshape(batch * heads, lq, dim), 1)  # one scale per query row
    kq, k_scale, vq, v_scale = quantize_kv(k.reshape(batch * heads, lk, dim), v.reshape(batch * heads, lk, dim))
    q32 = _dequantize_blocks(qq, q_scale, 1)
    k32 = _dequantize_blocks(kq, k_scale, K_BLOCK)
    s = (q32 @ k32.transpose(1, 2)) * (dim**-0.5 if scale is None else float(scale))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    p_q = (p * E4M3_MAX).to(torch.float8_e4m3fn).float() / E4M3_MAX
    out = (p_q @ (vq.float() * v_scale[:, None, :])) / p.sum(dim=-1, keepdim=True)
    return out.reshape(batch, heads, lq, dim).to(q.dtype)


def fp8_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """The driver's computation as the Triton kernels (CUDA, or CPU under Triton's interpreter):
    :func:`kv_statistics` here, then K and V quantized and attended in Triton. ``(B, H, L, D)``, any
    strides with a unit stride along D, no mask."""
    from fv_kernel.compute.fp8_triton import fp8_attention_kernel

    lq, dim = q.shape[2], q.shape[3]
    if k.shape[2] == 0 and lq > 0:
        raise Fp8Error("fp8 attention needs at least one key (softmax over zero keys is undefined)")
    k_mean, v_scale = kv_statistics(k, v)
    return fp8_attention_kernel(q, k, v, k_mean, v_scale, scale=dim**-0.5 if scale is None else float(scale),
                                k_block=K_BLOCK)


class Fp8Attention(AttentionBackend):
    """The ``fp8`` driver (see the module docstring). ``implementation``: ``"auto"`` (Triton on
    CUDA when importable, else torch), ``"triton"`` (CUDA, or CPU under Triton's interpreter) or
    ``"torch"`` (the reference, any device)."""

    name: ClassVar[str] = "fp8"

    def __init__(self, implementation: Literal["auto", "triton", "torch"] = "auto") -> None:
        if implementation not in ("auto", "triton", "torch"):
            raise Fp8Error(
                f"implementation must be 'auto', 'triton' or 'torch', got {implementation!r}", param="implementation"
            )
        self.implementation = implementation

    def supports(self, *, dtype: torch.dtype, device: torch.device, head_dim: int, has_mask: bool) -> bool:
        return not has_mask and dtype in (torch.float32, torch.float16, torch.bfloat16)

    def _uses_triton(self, device: torch.device) -> bool:
        if self.implementation != "auto":
            return self.implementation == "triton"
        from fv_kernel.compute.fused import triton_available

        return device.type == "cuda" and triton_available()

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        self.check_shapes(q, k, v)
        if attn_mask is not None or is_causal:
            raise AttentionBackendUnavailable(
                "attention backend 'fp8' takes no attn_mask and no is_causal (video DiT attention uses neither); "
                "use 'sdpa' for masked attention"
            )
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise AttentionBackendUnavailable(
                f"attention backend 'fp8' needs fp32, fp16 or bf16 q/k/v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
            )
        if v.shape[-1] != q.shape[-1]:
            raise AttentionBackendUnavailable(
                f"attention backend 'fp8' needs v's head_dim equal to q's, got {v.shape[-1]} and {q.shape[-1]}"
            )
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if self._uses_triton(q.device):
            return fp8_attention_triton(q, k, v, scale=scale)
        return fp8_attention_torch(q, k, v, scale=scale)
