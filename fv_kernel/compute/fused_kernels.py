"""The Triton kernels behind :class:`fv_kernel.compute.fused.TritonFusedOps` (imported on first use:
Triton is optional). One program per token row for the row ops; see each op's docstring in
:class:`~fv_kernel.compute.fused.FusedOps` for what it computes and where it rounds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fv_kernel.compute.fp8_triton import _e4m3_rows

__all__ = ["channel_bias_kernel", "channel_rms_silu_kernel", "residual_norm_kernel", "rms_rope_kernel"]


@triton.jit
def _quantize_row(v, mask, q_ptr, qs_ptr, row, base, cols, EMULATE: tl.constexpr):
    """Store one row (fp32 holding values already rounded to the activation dtype) as e4m3 and its scale,
    quantized as ``fp8_quantize_rows`` quantizes (``_e4m3_rows``)."""
    codes, scale = _e4m3_rows(tl.where(mask, v, 0.0)[None, :], EMULATE)
    tl.store(qs_ptr + row + tl.arange(0, 1), scale)
    tl.store(q_ptr + base + cols[None, :], codes, mask=mask[None, :])


@triton.jit
def residual_norm_kernel(
    x_ptr, y_ptr, x_out_ptr, out_ptr,
    gate_ptr, scale_ptr, shift_ptr, weight_ptr, bias_ptr, q_ptr, qs_ptr,
    tokens, width, eps,
    stride_gate_b, stride_gate_l, stride_mod_b, stride_mod_l, stride_shift_b, stride_shift_l,
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_AFFINE: tl.constexpr, HAS_MOD: tl.constexpr, QUANTIZE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    batch = row // tokens
    token = row % tokens
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    base = row * width
    h = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(gate_ptr + batch * stride_gate_b + token * stride_gate_l + cols, mask=mask, other=0.0)
            y = y * g
        # Round the new residual to the stream dtype, as the eager model stores it.
        h_low = (h + y).to(x_out_ptr.dtype.element_ty)
        tl.store(x_out_ptr + base + cols, h_low, mask=mask)
        h = h_low.to(tl.float32)
    if HAS_NORM:
        mean = tl.sum(h, axis=0) / width
        centered = tl.where(mask, h - mean, 0.0)
        var = tl.sum(centered * centered, axis=0) / width
        n = centered * tl.rsqrt(var + eps)
        if HAS_AFFINE:
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            n = n * w + b
        if HAS_MOD:
            s = tl.load(scale_ptr + batch * stride_mod_b + token * stride_mod_l + cols, mask=mask, other=0.0)
            t = tl.load(shift_ptr + batch * stride_shift_b + token * stride_shift_l + cols, mask=mask, other=0.0)
            n = n * (1.0 + s) + t
        if QUANTIZE:  # e4m3 rows for an fp8 linear; the activation-dtype rows are never written
            _quantize_row(n.to(out_ptr.dtype.element_ty).to(tl.float32), mask, q_ptr, qs_ptr, row, base, cols, EMULATE)
        else:
            tl.store(out_ptr + base + cols, n.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_rope_kernel(
    x_ptr, out_ptr, weight_ptr, cos_ptr, sin_ptr,
    tokens, width, half_head, eps,
    HAS_ROPE: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    token = row % tokens
    pairs = tl.arange(0, BLOCK_PAIRS)
    mask = pairs < width // 2
    base = row * width
    even = tl.load(x_ptr + base + 2 * pairs, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(x_ptr + base + 2 * pairs + 1, mask=mask, other=0.0).to(tl.float32)
    mean_sq = (tl.sum(even * even, axis=0) + tl.sum(odd * odd, axis=0)) / width
    rstd = tl.rsqrt(mean_sq + eps)
    # As torch's rms_norm: normalise in fp32, round to the input dtype, then apply the weight.
    low = out_ptr.dtype.element_ty
    w_even = tl.load(weight_ptr + 2 * pairs, mask=mask, other=0.0).to(tl.float32)
    w_odd = tl.load(weight_ptr + 2 * pairs + 1, mask=mask, other=0.0).to(tl.float32)
    even = ((even * rstd).to(low).to(tl.float32) * w_even).to(low).to(tl.float32)
    odd = ((odd * rstd).to(low).to(tl.float32) * w_odd).to(low).to(tl.float32)
    if HAS_ROPE:
        angle = token * half_head + pairs % half_head
        c = tl.load(cos_ptr + angle, mask=mask, other=0.0)
        s = tl.load(sin_ptr + angle, mask=mask, other=0.0)
        even, odd = even * c - odd * s, even * s + odd * c
    tl.store(out_ptr + base + 2 * pairs, even.to(low), mask=mask)
    tl.store(out_ptr + base + 2 * pairs + 1, odd.to(low), mask=mask)


@triton.jit
def channel_rms_silu_kernel(
    x_ptr, out_ptr, gain_ptr,
    voxels, channels, frames, height, width,
    sx_b, sx_c, sx_t, sx_h, sx_w, so_b, so_c, so_t, so_h, so_w,
    BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # A block of voxels x all channels: channels-last activations read each voxel's
    # channels contiguously; any strides work (the output is often a padded buffer's view).
    v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = v < voxels
    w = v % width
    rest = v // width
    h = rest % height
    rest = rest // height
    t = rest % frames
    b = rest // frames
    c = tl.arange(0, BLOCK_C)
    c_mask = c < channels
    mask = v_mask[:, None] & c_mask[None, :]
    x_at = b * sx_b + t * sx_t + h * sx_h + w * sx_w
    x = tl.load(x_ptr + x_at[:, None] + c[None, :] * sx_c, mask=mask, other=0.0).to(tl.float32)
    norm = tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)
    # The eager passes' roundings: quotient, gain product and SiLU each land in the activation dtype.
    low = out_ptr.dtype.element_ty
    n = (x / norm[:, None]).to(low).to(tl.float32)
    gain = tl.load(gain_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    n = (n * gain[None, :]).to(low).to(tl.float32)
    n = n / (1.0 + tl.exp(-n))
    out_at = b * so_b + t * so_t + h * so_h + w * so_w
    tl.store(out_ptr + out_at[:, None] + c[None, :] * so_c, n.to(low), mask=mask)


@triton.jit
def channel_bias_kernel(x_ptr, bias_ptr, numel, channels, inner, CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    # Memory order, one flat block per program: channels innermost (channels-last) or ``inner`` elements a channel.
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = at < numel
    c = at % channels if CHANNELS_LAST else (at // inner) % channels
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + at, (x + b).to(x_ptr.dtype.element_ty), mask=mask)
