"""Triton FP8 kernels: per-token activation quantization, the e4m3 linear and e4m3 attention (docs/precision.md).

**Activation quantization** (:func:`fp8_quantize_rows`): one read of a ``[M, K]`` activation (two for
rows wider than :data:`WHOLE_ROW_LIMIT`), each row's absmax, then the row as e4m3 and its fp32 scale
(absmax / 448). It feeds both the
Triton GEMM here and ``torch._scaled_mm`` (:mod:`fv_kernel.compute.fp8`). It replaced a quantization
in the GEMM's prologue, which re-read every row once per output tile (70 times for Wan's FFN) and
ran the GEMM 4-7x slower than cuBLAS bf16 on an H100 (docs/benchmarks.md, 2026-12-05).

**Linear** (:func:`fp8_linear_triton`, an :data:`fv_kernel.compute.fp8.Fp8Kernel`): the weight is e4m3
``[N, K]`` with an fp32 scale per output channel, quantized once at load. ``fp8_weights`` loads
e4m3 weight tiles and widens them to the activation's dtype in registers (no dequantized weight
is ever written); ``fp8_dynamic`` multiplies the quantized activation by the weight, e4m3 by e4m3
with fp32 accumulation. Both scales and the bias are applied in the epilogue. Programs walk the
output in groups of ``GROUP_M`` row tiles so that neighbouring programs share weight tiles in L2.

**Attention** (:func:`fp8_attention_kernel`): FlashAttention-style online softmax in base 2. Q is
quantized in the kernel, one scale per query row; K (smoothed: its mean over tokens subtracted,
which softmax ignores) with one scale per block of keys (128, the driver's ``K_BLOCK``); P with the fixed scale 448
(P is in [0, 1]; the factor is folded into the exponent and cancels against the row sums); V with
one scale per channel. Both products are e4m3 x e4m3 with fp32 accumulation. K and V are
quantized by one Triton pass (:func:`_quantize_kv_kernel`) into buffers padded to a multiple of
that block and a power-of-two head dim, V transposed (Hopper's e4m3 tensor-core
dot wants its B operand contiguous along the reduction axis), so that the main loop loads whole
tiles without masks; only the last, partial block of keys masks its scores. Q, K and V are read
through their strides (a ``(B, L, H, D)`` layout viewed as ``(B, H, L, D)`` is not copied). The
block sizes are autotuned per head dim and key-length bucket on CUDA (:data:`ATTENTION_CONFIGS`).

All run on CUDA (sm_89+ for the e4m3 tensor-core dot), or on CPU in Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported), which is how they are tested. The
interpreter's float32 -> e4m3 cast loses the carry when rounding up reaches the next power of two
(7.8 becomes 4, not 8), so under the interpreter the kernels first round to the e4m3 grid in fp32
(``EMULATE_ROUNDING``) and the cast is then exact; on CUDA the hardware cast rounds to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fv_kernel.errors import FvError

__all__ = [
    "ATTENTION_CONFIGS",
    "K_SCALE_BLOCK",
    "WHOLE_ROW_LIMIT",
    "Fp8KernelError",
    "Fp8KernelUnavailable",
    "fp8_attention_kernel",
    "fp8_linear_triton",
    "fp8_quantize_rows",
    "triton_interpreted",
]

#: The smallest block of keys sharing one K scale (the driver's ``K_BLOCK`` is 128): every BLOCK_N of
#: the attention kernel divides it, so a key tile has one scale.
K_SCALE_BLOCK = 128
_LOG2E = 1.4426950408889634


class Fp8KernelUnavailable(FvError, RuntimeError):
    """An FP8 Triton kernel was asked to run where it cannot (a CPU tensor outside the interpreter)."""

    error_type = "fp8_kernel_unavailable"


class Fp8KernelError(FvError, ValueError):
    """Tensors an FP8 Triton kernel cannot take (shape, dtype or mode)."""

    error_type = "invalid_precision"


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
def _to_e4m3(x, EMULATE_ROUNDING: tl.constexpr):
    """fp32 within ±448 as e4m3, rounded to nearest even (see the module docstring on the interpreter)."""
    if EMULATE_ROUNDING:
        x = _round_to_e4m3_grid(x)
    return x.to(tl.float8e4nv)


# --------------------------------------------------------------------------- per-token activation quantization


@triton.jit
def _e4m3_rows(x, EMULATE_ROUNDING: tl.constexpr):
    """Each row of ``x [R, K]`` (fp32, padding entries 0) as e4m3, with its fp32 scale ``[R]``: absmax / 448
    (at least 1e-12), the quotient clamped to ±448 and rounded to nearest even. The one definition of a
    row's quantization, for the kernel below and the fused norm and GELU kernels (``fused_kernels``)."""
    scale = tl.maximum(tl.max(tl.abs(x), 1) / 448.0, 1e-12)
    return _to_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0), EMULATE_ROUNDING), scale


@triton.jit
def _gelu_tanh(h):
    """torch's tanh GELU in fp32: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (e^2u + 1)."""
    inner = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    # e^2u clamped below fp32's overflow: past 60 the quotient is 0 in fp32 either way
    return 0.5 * h * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * inner, 60.0)) + 1.0))


@triton.jit
def _load_rows(x_ptr, rm, kk, ok, stride_xm, GELU: tl.constexpr):
    """A tile of rows in fp32; with ``GELU``, the tanh GELU of it rounded to the input's dtype (what
    ``F.gelu(x, approximate="tanh")`` stores), so the rows quantized are those the composed ops quantize."""
    x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=ok, other=0.0)
    if GELU:  # gelu(0) = 0: the padding stays 0
        return _gelu_tanh(x.to(tl.float32)).to(x.dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, xq_ptr, xs_ptr, M, K, stride_xm,
    EMULATE_ROUNDING: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, WHOLE_ROWS: tl.constexpr,
    GELU: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    if WHOLE_ROWS:  # a row fits one tile: read it once
        ok = m_ok[:, None] & (rk < K)[None, :]
        xq, scale = _e4m3_rows(_load_rows(x_ptr, rm, rk, ok, stride_xm, GELU), EMULATE_ROUNDING)
        tl.store(xs_ptr + rm, scale, mask=m_ok)
        tl.store(xq_ptr + rm[:, None] * K + rk[None, :], xq, mask=ok)
    else:  # wider rows: the absmax pass, then the quantizing pass (its reads mostly from L2; a GELU recomputed)
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            kk = k + rk
            ok = m_ok[:, None] & (kk < K)[None, :]
            amax = tl.maximum(amax, tl.max(tl.abs(_load_rows(x_ptr, rm, kk, ok, stride_xm, GELU)), 1))
        scale = tl.maximum(amax / 448.0, 1e-12)
        tl.store(xs_ptr + rm, scale, mask=m_ok)
        for k in range(0, K, BLOCK_K):
            kk = k + rk
            ok = m_ok[:, None] & (kk < K)[None, :]
            xt = _load_rows(x_ptr, rm, kk, ok, stride_xm, GELU)
            xq = _to_e4m3(tl.clamp(xt / scale[:, None], -448.0, 448.0), EMULATE_ROUNDING)
            tl.store(xq_ptr + rm[:, None] * K + kk[None, :], xq, mask=ok)


#: The widest row :func:`fp8_quantize_rows` reads once (a tile of this many elements per program, 8 warps);
#: wider rows take two passes. The FFN's 8,960-wide activation took 0.50 ms on an H100 in two passes.
WHOLE_ROW_LIMIT = 16384
#: The same for the GELU's rows (:func:`fp8_gelu_quantize_rows`): the GELU's registers beside a whole
#: 16k tile made one pass over 8,960-wide rows 0.89 ms on an H100, against 0.68 ms for the GELU then
#: the row quantization (2026-12-06), so wider rows than this take the two passes.
GELU_WHOLE_ROW_LIMIT = 4096


def _launch_quantize_rows(x: torch.Tensor, *, gelu: bool, whole_row_limit: int, block_k: int = 1024,
                          tile: int = 4096, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]``'s rows (or their GELU's) quantized; ``block_k`` the chunk of a row too wide for one
    tile, ``tile`` the elements one program takes (several rows when they are short)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise Fp8KernelError(f"per-row quantization takes a 2-D activation with unit stride along K, got shape "
                             f"{tuple(x.shape)} and strides {x.stride()}")
    emulate = _require_runnable(x, "fp8 row quantization")
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return xq, xs
    if k == 0:
        return xq, xs.fill_(1e-12)
    whole = triton.next_power_of_2(k) <= whole_row_limit
    block_k = triton.next_power_of_2(k) if whole else block_k
    rows = max(1, tile // block_k)
    _quantize_rows_kernel[(triton.cdiv(m, rows),)](
        x, xq, xs, m, k, x.stride(0), EMULATE_ROUNDING=emulate, ROWS=rows, BLOCK_K=block_k, WHOLE_ROWS=whole,
        GELU=gelu, num_warps=num_warps or (8 if block_k * rows >= 8192 else 4),
    )  # fmt: skip
    return xq, xs


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of ``x [M, K]`` (rows may be strided): ``(e4m3 [M, K], fp32 scale [M, 1])``,
    ``x ≈ q.float() · scale``, scale = row absmax / 448 (at least 1e-12), rounded to nearest even."""
    return _launch_quantize_rows(x, gelu=False, whole_row_limit=WHOLE_ROW_LIMIT)


def fp8_gelu_quantize_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.gelu(h, approximate="tanh")`` (rounded to ``h.dtype``) quantized per row as :func:`fp8_quantize_rows`
    quantizes, in one kernel: ``h`` is read, and the e4m3 rows written, without the GELU's output in memory."""
    return _launch_quantize_rows(h, gelu=True, whole_row_limit=GELU_WHOLE_ROW_LIMIT)


# --------------------------------------------------------------------------- linear


@triton.jit
def _fp8_linear_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K,
    A_E4M3: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # Grouped order: GROUP_M row tiles sweep the same column tiles together, reusing W from L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        k_ok = kk < K
        at = tl.load(a_ptr + rm[:, None] * K + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [K, N]: Wᵀ
        if A_E4M3:
            acc = tl.dot(at, wt, acc)  # e4m3 x e4m3, fp32 accumulation
        else:
            acc = tl.dot(at, wt.to(at.dtype), acc, input_precision=PRECISION)
    y = acc * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if A_E4M3:
        y = y * tl.load(as_ptr + rm, mask=m_ok, other=0.0)[:, None]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _block(n: int, largest: int) -> int:
    return max(16, min(largest, triton.next_power_of_2(max(n, 1))))


def fp8_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, mode: str,
    out_dtype: torch.dtype, *, x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K] · dequant(weight [N, K], scale)ᵀ + bias`` as :class:`~fv_kernel.compute.fp8.Fp8Linear`
    computes it (``mode``: ``"fp8_weights"`` or ``"fp8_dynamic"``; the latter quantizes ``x`` per
    token with :func:`fp8_quantize_rows` first, unless ``x`` arrives quantized: e4m3 rows with their
    fp32 scales ``x_scale [M, 1]``). ``scale`` is fp32 ``[N]`` (per output channel) or
    0-dim (per tensor); the output is ``out_dtype``."""
    if mode not in ("fp8_weights", "fp8_dynamic"):
        raise Fp8KernelError(f"mode must be 'fp8_weights' or 'fp8_dynamic', got {mode!r}", param="mode")
    prequantized = x_scale is not None
    if prequantized and (mode != "fp8_dynamic" or x.dtype != torch.float8_e4m3fn or tuple(x_scale.shape) != (x.shape[0], 1)):
        raise Fp8KernelError(f"x_scale goes with e4m3 rows x [M, K] and fp32 scales [M, 1] in mode 'fp8_dynamic'; got mode "
                             f"{mode!r}, x {tuple(x.shape)} {x.dtype}, x_scale {tuple(x_scale.shape)}", param="mode")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.dtype != torch.float8_e4m3fn:
        raise Fp8KernelError(f"fp8 linear: x {tuple(x.shape)} and e4m3 weight [N, K] {tuple(weight.shape)} ({weight.dtype}) do not fit")
    m, k = x.shape
    n = weight.shape[0]
    if scale.numel() not in (1, n):
        raise Fp8KernelError(f"weight_scale must hold 1 or {n} (one per output channel) values, got shape {tuple(scale.shape)}")
    _require_runnable(x, "fp8 linear")
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    w_scale = scale.float().reshape(-1).expand(n).contiguous()
    dynamic = mode == "fp8_dynamic"
    if prequantized:
        a, a_scale = x.contiguous(), x_scale.contiguous()
    elif dynamic:
        a, a_scale = fp8_quantize_rows(x.contiguous())
    else:
        a, a_scale = x.contiguous(), w_scale  # a_scale unread without A_E4M3
    # e4m3 tiles: 128x256x128 with 8 warps (Hopper wgmma's sweet spot); K >= 32 for the e4m3 dot.
    block_m, block_n = _block(m, 128), _block(n, 256 if dynamic else 128)
    block_k = max(32, _block(k, 128 if dynamic else 64))
    warps = 8 if block_m * block_n >= 128 * 256 else 4
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_linear_kernel[grid](
        a, a_scale, weight.contiguous(), w_scale, bias if bias is not None else w_scale, y, m, n, k,
        A_E4M3=dynamic, HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=3,
    )  # fmt: skip
    return y


# --------------------------------------------------------------------------- attention


@triton.jit
def _quantize_kv_kernel(
    k_ptr, v_ptr, kmean_ptr, vs_ptr, kq_ptr, ks_ptr, vt_ptr, H, LK, LK_PAD, D,
    stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
    EMULATE_ROUNDING: tl.constexpr, KSB: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One block of ``KSB`` keys of one (batch, head): K - mean -> e4m3 with one scale; V / its channel scales -> e4m3, transposed."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rl = blk.to(tl.int64) * KSB + tl.arange(0, KSB).to(tl.int64)
    rd = tl.arange(0, BLOCK_D)
    ok = (rl < LK)[:, None] & (rd < D)[None, :]
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + rl[:, None] * stride_kl + rd[None, :], mask=ok, other=0.0)
    k = tl.where(ok, k.to(tl.float32) - tl.load(kmean_ptr + bh * D + rd, mask=rd < D, other=0.0)[None, :], 0.0)
    k_scale = tl.maximum(tl.max(tl.max(tl.abs(k), 1), 0) / 448.0, 1e-12)
    tl.store(ks_ptr + bh * (LK_PAD // KSB) + blk, k_scale)
    kq = _to_e4m3(tl.clamp(k / k_scale, -448.0, 448.0), EMULATE_ROUNDING)
    tl.store(kq_ptr + bh * LK_PAD * BLOCK_D + rl[:, None] * BLOCK_D + rd[None, :], kq)  # padding rows/cols are 0
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + rl[:, None] * stride_vl + rd[None, :], mask=ok, other=0.0)
    v_scale = tl.load(vs_ptr + bh * D + rd, mask=rd < D, other=1.0)
    vq = _to_e4m3(tl.clamp(v.to(tl.float32) / v_scale[None, :], -448.0, 448.0), EMULATE_ROUNDING)
    tl.store(vt_ptr + bh * BLOCK_D * LK_PAD + rd[None, :] * LK_PAD + rl[:, None], vq)


@triton.jit
def _attend_key_block(
    acc, l_i, m_i, qq, row_factor, k_head, ks_head, vt_head, start, LK, LK_PAD,
    EMULATE_ROUNDING: tl.constexpr, MASKED: tl.constexpr, KSB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rn = start + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    kt = tl.load(k_head + rn[None, :] * BLOCK_D + rd[:, None])  # [D, N]: Kᵀ, contiguous along D (K-major)
    k_scale = tl.load(ks_head + start // KSB)
    s = tl.dot(qq, kt) * (row_factor * k_scale)[:, None]  # e4m3 x e4m3 -> fp32, in log2 units
    if MASKED:
        s = tl.where((rn < LK)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # P·448 directly: the exponent carries log2(448), so P's e4m3 scale costs no multiply.
    p = tl.math.exp2(s - (m_new - 8.807354922057604)[:, None])  # log2(448)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if EMULATE_ROUNDING:
        p = tl.minimum(p, 448.0)
    vt = tl.load(vt_head + rd[None, :] * LK_PAD + rn[:, None])  # [N, D], contiguous along N
    acc = acc * alpha[:, None] + tl.dot(_to_e4m3(p, EMULATE_ROUNDING), vt)
    return acc, l_i, m_new


@triton.jit
def _fp8_attention_kernel(
    q_ptr, kq_ptr, ks_ptr, vt_ptr, vs_ptr, o_ptr, H, LQ, LK, LK_PAD, D,
    stride_qb, stride_qh, stride_ql, stride_ob, stride_oh, stride_ol, qk_scale, LK_BUCKET,
    EMULATE_ROUNDING: tl.constexpr, KSB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rd = tl.arange(0, BLOCK_D)
    q_ok = (rm < LQ)[:, None] & (rd < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rm[:, None] * stride_ql + rd[None, :], mask=q_ok, other=0.0)
    q = q.to(tl.float32)
    q_scale = tl.maximum(tl.max(tl.abs(q), 1) / 448.0, 1e-12)  # one scale per query row
    qq = _to_e4m3(tl.clamp(q / q_scale[:, None], -448.0, 448.0), EMULATE_ROUNDING)
    row_factor = q_scale * qk_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_head = kq_ptr + bh * LK_PAD * BLOCK_D
    vt_head = vt_ptr + bh * BLOCK_D * LK_PAD
    ks_head = ks_ptr + bh * (LK_PAD // KSB)
    full = (LK // BLOCK_N) * BLOCK_N
    for start in range(0, full, BLOCK_N):
        acc, l_i, m_i = _attend_key_block(
            acc, l_i, m_i, qq, row_factor, k_head, ks_head, vt_head, start, LK, LK_PAD,
            EMULATE_ROUNDING, False, KSB, BLOCK_N, BLOCK_D)  # fmt: skip
    if full < LK:  # the last, partial block of keys: padded keys get no weight
        acc, l_i, m_i = _attend_key_block(
            acc, l_i, m_i, qq, row_factor, k_head, ks_head, vt_head, full, LK, LK_PAD,
            EMULATE_ROUNDING, True, KSB, BLOCK_N, BLOCK_D)  # fmt: skip
    v_scale = tl.load(vs_ptr + bh * D + rd, mask=rd < D, other=0.0)
    out = acc * v_scale[None, :] / l_i[:, None]  # the 448 in P cancels against the same factor in l_i
    o_rows = o_ptr + b * stride_ob + h * stride_oh + rm[:, None] * stride_ol
    tl.store(o_rows + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=q_ok)


#: The attention kernel's candidate tiles on CUDA: (BLOCK_M, BLOCK_N) with warps and pipeline stages, each
#: building e4m3 wgmma for both products on sm_90 with at most 128 bytes of register spills (tested;
#: 128x64 with 4 warps, for one, spills 3.4 KB). Triton's autotuner times them once per (head dim,
#: key-length bucket) in a process; the interpreter runs the first.
ATTENTION_CONFIGS: tuple[triton.Config, ...] = tuple(
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bm, bn, w, s in ((128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4),
                         (64, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4))
)

_fp8_attention_tuned = triton.autotune(list(ATTENTION_CONFIGS), key=["BLOCK_D", "LK_BUCKET"])(_fp8_attention_kernel)


def fp8_attention_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_mean: torch.Tensor, v_scale: torch.Tensor, *, scale: float,
    k_block: int = K_SCALE_BLOCK,
) -> torch.Tensor:
    """Quantize K and V (one Triton pass) and run the attention kernel. ``q`` ``(B, H, Lq, D)`` and
    ``k``/``v`` ``(B, H, Lk, D)`` in one float dtype, any strides with a unit stride along D;
    ``k_mean`` and ``v_scale`` fp32 ``(B, H, D)``: K's mean over tokens and V's per-channel scale
    (absmax / 448), from :func:`fv_kernel.compute.fp8_attention.kv_statistics`; ``k_block`` keys share
    one K scale (a power of two, at least :data:`K_SCALE_BLOCK`). Returns ``(B, H, Lq, D)`` in q's dtype
    and memory layout (``torch.empty_like(q)``). :func:`fv_kernel.compute.fp8_attention.fp8_attention_triton` calls it."""
    batch, heads, lq, dim = q.shape
    lk = k.shape[2]
    if (
        q.dim() != 4 or tuple(k.shape) != (batch, heads, lk, dim) or tuple(v.shape) != (batch, heads, lk, dim)
        or tuple(k_mean.shape) != (batch, heads, dim) or tuple(v_scale.shape) != (batch, heads, dim)
        or not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16)
    ):
        raise Fp8KernelError(
            f"fp8 attention: q {tuple(q.shape)} ({q.dtype}), k {tuple(k.shape)} ({k.dtype}), v {tuple(v.shape)} "
            f"({v.dtype}), k_mean {tuple(k_mean.shape)}, v_scale {tuple(v_scale.shape)} do not fit"
        )
    if k_block < K_SCALE_BLOCK or k_block & (k_block - 1):  # one program quantizes a block: a power of two
        raise Fp8KernelError(f"k_block must be a power of two of at least {K_SCALE_BLOCK}, got {k_block}", param="k_block")
    emulate = _require_runnable(q, "fp8 attention")
    # q's memory layout: the blocks' (B, L, H, D) viewed as (B, H, L, D) comes back as that view, so
    # transposing it back for the output projection is free (as after cuDNN's SDPA), not a copy.
    out = torch.empty_like(q)
    if lq == 0 or batch * heads == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    block_d = max(32, triton.next_power_of_2(dim))  # the e4m3 dot reduces over at least 32
    lk_pad = triton.cdiv(lk, k_block) * k_block
    bh = batch * heads
    kq = torch.empty(bh, lk_pad, block_d, dtype=torch.float8_e4m3fn, device=q.device)
    vt = torch.empty(bh, block_d, lk_pad, dtype=torch.float8_e4m3fn, device=q.device)
    ks = torch.empty(bh, lk_pad // k_block, dtype=torch.float32, device=q.device)
    k_mean = k_mean.float().contiguous()
    v_scale = v_scale.float().contiguous()
    _quantize_kv_kernel[(lk_pad // k_block, bh)](
        k, v, k_mean, v_scale, kq, ks, vt, heads, lk, lk_pad, dim,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        EMULATE_ROUNDING=emulate, KSB=k_block, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    args = (q, kq, ks, vt, v_scale, out, heads, lq, lk, lk_pad, dim, q.stride(0), q.stride(1), q.stride(2),
            out.stride(0), out.stride(1), out.stride(2), float(scale) * _LOG2E, triton.next_power_of_2(lk))
    if emulate:  # the interpreter: one configuration, not a timing sweep
        config = ATTENTION_CONFIGS[0].all_kwargs()
        _fp8_attention_kernel[(triton.cdiv(lq, config["BLOCK_M"]), bh)](
            *args, EMULATE_ROUNDING=True, KSB=k_block, BLOCK_D=block_d, **config)
    else:
        _fp8_attention_tuned[lambda meta: (triton.cdiv(lq, meta["BLOCK_M"]), bh)](
            *args, EMULATE_ROUNDING=False, KSB=k_block, BLOCK_D=block_d)
    return out
