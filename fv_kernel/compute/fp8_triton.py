"""Triton FP8 kernels: the e4m3 linear and e4m3 attention (docs/precision.md).

**Linear** (:func:`fp8_linear_triton`, an :data:`fv_kernel.compute.fp8.Fp8Kernel`): the weight is e4m3
``[N, K]`` with an fp32 scale per output channel, quantized once at load. ``fp8_weights`` loads
e4m3 weight tiles, widens them to the activation's dtype in registers and applies the channel
scale in the epilogue (no dequantized weight is ever written). ``fp8_dynamic`` quantizes the
activation per token *in the GEMM's prologue*: each program first reduces its ``BLOCK_M`` rows'
absmax over K, then quantizes every activation tile to e4m3 as it loads it and multiplies e4m3 by
e4m3 with fp32 accumulation; both scales and the bias are applied in the epilogue. The activation
is read twice from L2/HBM by each program (once for the absmax) but no e4m3 copy of it is ever
written: the eager per-row quantization this replaces cost 0.53 ms before a 0.14 ms GEMM on an
H200 (docs/precision.md). The prologue was chosen over fusing into the preceding norm/modulation
kernel because it needs no change to any producer (it works after any op, for any model) and its
result is the same per-token quantization ``torch`` computes.

**Attention** (:func:`fp8_attention_triton`): FlashAttention-style online softmax with Q in e4m3
per query block (quantized in the kernel, one scale per ``Q_BLOCK`` rows), K smoothed (its mean
over tokens subtracted: softmax is invariant to it) and quantized per ``K_BLOCK`` keys, P quantized
to e4m3 with the fixed scale 1/448 (P is in [0, 1]), V in e4m3 with a scale per channel; both
products accumulate in fp32. K and V are quantized by :func:`fv_kernel.compute.fp8_attention.quantize_kv`, in torch, once per call.

Both run on CUDA (sm_89+ for the e4m3 tensor-core dot), or on CPU in Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported), which is how they are tested. The
interpreter's float32 -> e4m3 cast loses the carry when rounding up reaches the next power of two
(7.8 becomes 4, not 8), so under the interpreter the kernels first round to the e4m3 grid in fp32
(``EMULATE_ROUNDING``) and the cast is then exact; on CUDA the hardware cast rounds to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fv_kernel.compute.fp8 import Fp8Error
from fv_kernel.compute.fp8_attention import K_BLOCK, Q_BLOCK, quantize_kv

__all__ = [
    "Fp8KernelUnavailable",
    "fp8_attention_triton",
    "fp8_linear_triton",
    "triton_interpreted",
]



class Fp8KernelUnavailable(Fp8Error):
    """An FP8 Triton kernel was asked to run where it cannot (a CPU tensor outside the interpreter)."""

    error_type = "fp8_kernel_unavailable"


def triton_interpreted() -> bool:
    """Whether this process runs Triton kernels in the CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_fp8_linear_kernel, InterpretedFunction)


def _require_runnable(x: torch.Tensor, what: str) -> bool:
    """Returns whether to emulate rounding (the interpreter); raises where the kernel cannot run."""
    if x.device.type == "cuda":
        return False
    if not triton_interpreted():
        raise Fp8KernelUnavailable(
            f"the Triton {what} got a {x.device.type} tensor: it runs on CUDA, or on CPU only under Triton's "
            "interpreter (TRITON_INTERPRET=1 set before the process imports triton); use kernel='torch' there",
            param="kernel",
        )
    return True


@triton.jit
def _round_to_e4m3_grid(x):
    """``x`` (fp32, within ±448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # below 2**-6 e4m3 is subnormal, with a fixed step of 2**-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    magic = step * 12582912.0  # 1.5 * 2**23 ulps of ``step``: adding it rounds x to a multiple of step
    return (x + magic) - magic


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K,
    DYNAMIC: tl.constexpr, HAS_BIAS: tl.constexpr, EMULATE_ROUNDING: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    if DYNAMIC:  # prologue: each row's absmax over K (the per-token scale)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            kk = k + rk
            xt = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xt.to(tl.float32)), 1))
        x_scale = tl.maximum(amax / 448.0, 1e-12)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        k_ok = kk < K
        xt = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [K, N]: Wᵀ
        if DYNAMIC:
            xq = tl.clamp(xt.to(tl.float32) / x_scale[:, None], -448.0, 448.0)
            if EMULATE_ROUNDING:
                xq = _round_to_e4m3_grid(xq)
            acc = tl.dot(xq.to(tl.float8e4nv), wt, acc)
        else:
            acc = tl.dot(xt, wt.to(xt.dtype), acc, input_precision=PRECISION)
    w_scale = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    y = acc * w_scale[None, :]
    if DYNAMIC:
        y = y * x_scale[:, None]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _block(n: int, largest: int) -> int:
    return max(16, min(largest, 1 << max(0, (n - 1).bit_length())))


def fp8_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, mode: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x [M, K] · dequant(weight [N, K], scale)ᵀ + bias`` as :class:`~fv_kernel.compute.fp8.Fp8Linear`
    computes it (``mode``: ``"fp8_weights"`` or ``"fp8_dynamic"``), in one Triton launch. ``scale``
    is fp32 ``[N]`` (per output channel) or 0-dim (per tensor); the output is ``out_dtype``."""
    if mode not in ("fp8_weights", "fp8_dynamic"):
        raise Fp8Error(f"mode must be 'fp8_weights' or 'fp8_dynamic', got {mode!r}", param="mode")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.dtype != torch.float8_e4m3fn:
        raise Fp8Error(f"fp8 linear: x {tuple(x.shape)} and e4m3 weight [N, K] {tuple(weight.shape)} ({weight.dtype}) do not fit")
    m, k = x.shape
    n = weight.shape[0]
    if scale.numel() not in (1, n):
        raise Fp8Error(f"weight_scale must hold 1 or {n} (one per output channel) values, got shape {tuple(scale.shape)}")
    emulate = _require_runnable(x, "fp8 linear")
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    x = x.contiguous()
    w_scale = scale.float().reshape(-1).expand(n).contiguous()
    block_m, block_n, block_k = _block(m, 128), _block(n, 128), _block(k, 64 if mode == "fp8_dynamic" else 32)
    block_k = max(block_k, 32)  # the e4m3 tensor-core dot needs K >= 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_linear_kernel[grid](
        x, weight.contiguous(), w_scale, bias if bias is not None else w_scale, y, m, n, k,
        DYNAMIC=mode == "fp8_dynamic", HAS_BIAS=bias is not None, EMULATE_ROUNDING=emulate,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y


# --------------------------------------------------------------------------- attention


@triton.jit
def _fp8_attention_kernel(
    q_ptr, k_ptr, ks_ptr, vt_ptr, vs_ptr, o_ptr, LQ, LK, D, K_BLOCKS, sm_scale,
    EMULATE_ROUNDING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1).to(tl.int64)
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rd = tl.arange(0, BLOCK_D)
    m_ok = rm < LQ
    d_ok = rd < D
    q_off = bh * LQ * D + rm[:, None] * D + rd[None, :]
    q = tl.load(q_ptr + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q_scale = tl.maximum(tl.max(tl.max(tl.abs(q), 1), 0) / 448.0, 1e-12)  # one scale per query block
    qq = tl.clamp(q / q_scale, -448.0, 448.0)
    if EMULATE_ROUNDING:
        qq = _round_to_e4m3_grid(qq)
    qq = qq.to(tl.float8e4nv)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, LK, BLOCK_N):
        rn = start + tl.arange(0, BLOCK_N).to(tl.int64)
        n_ok = rn < LK
        kt = tl.load(k_ptr + bh * LK * D + rn[None, :] * D + rd[:, None], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        k_scale = tl.load(ks_ptr + bh * K_BLOCKS + start // BLOCK_N)
        s = tl.dot(qq, kt) * (q_scale * k_scale * sm_scale)  # e4m3 x e4m3, fp32 accumulation
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        pq = p * 448.0  # P in [0, 1]: the fixed scale 1/448 uses e4m3's whole range
        if EMULATE_ROUNDING:
            pq = _round_to_e4m3_grid(pq)
        # V is stored transposed ([BH, D, L]): the e4m3 dot's B operand contiguous along its K (token) axis.
        vt = tl.load(vt_ptr + bh * D * LK + rd[None, :] * LK + rn[:, None], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(pq.to(tl.float8e4nv), vt)
        m_i = m_new
    v_scale = tl.load(vs_ptr + bh * D + rd, mask=d_ok, other=0.0)
    out = acc * (v_scale[None, :] / 448.0) / l_i[:, None]
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def fp8_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """FP8 softmax attention of ``(B, H, L, D)`` tensors (``k``/``v`` with as many heads as ``q``), no mask.

    The output has ``q``'s dtype. See the module docstring for the quantization."""
    emulate = _require_runnable(q, "fp8 attention")
    batch, heads, lq, dim = q.shape
    lk = k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if lq == 0 or batch * heads == 0:
        return out
    if lk == 0:
        raise Fp8Error("fp8 attention needs at least one key (softmax over zero keys is undefined)")
    kq, k_scale, vq, v_scale = quantize_kv(k.reshape(batch * heads, lk, dim), v.reshape(batch * heads, lk, dim))
    vt = vq.transpose(1, 2).contiguous()
    grid = (triton.cdiv(lq, Q_BLOCK), batch * heads)
    _fp8_attention_kernel[grid](
        q.contiguous(), kq.contiguous(), k_scale.contiguous(), vt, v_scale.contiguous(), out, lq, lk, dim,
        k_scale.shape[1], dim**-0.5 if scale is None else float(scale),
        EMULATE_ROUNDING=emulate, BLOCK_M=Q_BLOCK, BLOCK_N=K_BLOCK, BLOCK_D=max(32, 1 << (dim - 1).bit_length()),
    )  # fmt: skip
    return out
