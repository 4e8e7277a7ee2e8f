"""Triton kernels for the reasoner's captured decode step (``compute.fused_ops: triton`` with ``cuda_graphs``).

At batch 1 a decode step reads the reasoner's weights once (the GEMMs) and spends the rest in about 14 small
kernels a layer: two RMSNorms and their weight multiplies, the residual adds, q/k's norm, gain and RoPE (five
kernels), the K/V writes into the history, SiLU and its multiply. Inside a CUDA graph each still costs a few
microseconds of launch and tail; at 36 layers that is about a millisecond of a 6–7 ms step. Three kernels do the
same work:

* :meth:`DecodeKernels.add_rms_norm`: the residual add and the next RMSNorm (with its weight), one read of each
  input, both outputs written;
* :meth:`DecodeKernels.qk_norm_rope_store`: every head of one layer's packed q/k/v row: q's and k's RMSNorm with
  their per-head gain, RoPE (``rotate_half``), q written for attention, k and v written into the history at each
  row's position and into the step's rows for the pool;
* :meth:`DecodeKernels.silu_mul`: ``silu(gate) * up``.

Each rounds where the composed step rounds (``fv_cosmos3.graphed_decode.static_decode_step``: every op's output
in the activation dtype), so the two agree but for the order of a norm's fp32 sum. They run on CUDA, or on the CPU
under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported), which is how the CPU tests
check them (``tests/test_decode_kernels.py``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

__all__ = ["DecodeKernels", "DecodeKernelsUnavailable", "decode_kernels_available"]


class DecodeKernelsUnavailable(RuntimeError):
    """The decode kernels cannot run here (no triton, no CUDA) or on this model (a layer they do not cover)."""


def decode_kernels_available() -> bool:
    """Whether triton can be imported (it is not a dependency of fv-cosmos3)."""
    return importlib.util.find_spec("triton") is not None


def _build() -> tuple[Any, Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(
        hidden_ptr, delta_ptr, hidden_out_ptr, out_ptr, weight_ptr, width, eps,
        HAS_DELTA: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        base = row * width
        low = out_ptr.dtype.element_ty
        h = tl.load(hidden_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            # The residual stream is stored in the activation dtype: round the sum before normalising it.
            d = tl.load(delta_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            summed = (h + d).to(low)
            tl.store(hidden_out_ptr + base + cols, summed, mask=mask)
            h = summed.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / width + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        n = h * rstd
        if ROUND_BEFORE_WEIGHT:  # the Qwen convention: round the normalised row, then multiply by the weight
            n = n.to(low).to(tl.float32)
        tl.store(out_ptr + base + cols, (n * w).to(low), mask=mask)

    @triton.jit
    def qk_norm_rope_store_kernel(
        heads_ptr, gains_ptr, cos_ptr, sin_ptr, position_ptr,
        q_ptr, history_k_ptr, history_v_ptr, rows_k_ptr, rows_v_ptr,
        q_heads, kv_heads, eps,
        hk_head, hk_row, hk_pos, hv_head, hv_row, hv_pos,
        HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        low = q_ptr.dtype.element_ty
        row = heads_ptr + (b * (q_heads + 2 * kv_heads) + h) * HEAD_DIM
        x = tl.load(row + d).to(tl.float32)
        position = tl.load(position_ptr + b)
        if h < q_heads + kv_heads:
            # rotate_half pairs element d with d +- HEAD_DIM/2: the norm's rstd is the row's, so the partner's
            # normalised value is computed here from its own load, with the same roundings.
            swapped = (d + HEAD_DIM // 2) % HEAD_DIM
            partner = tl.load(row + swapped).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
            gain = tl.load(gains_ptr + h * HEAD_DIM + d).to(tl.float32)
            partner_gain = tl.load(gains_ptr + h * HEAD_DIM + swapped).to(tl.float32)
            n = ((x * rstd).to(low).to(tl.float32) * gain).to(low).to(tl.float32)
            p = ((partner * rstd).to(low).to(tl.float32) * partner_gain).to(low).to(tl.float32)
            c = tl.load(cos_ptr + b * HEAD_DIM + d).to(tl.float32)
            s = tl.load(sin_ptr + b * HEAD_DIM + d).to(tl.float32)  # sin with its first half negated
            rotated = ((n * c).to(low).to(tl.float32) + (p * s).to(low).to(tl.float32)).to(low)
            if h < q_heads:
                tl.store(q_ptr + (b * q_heads + h) * HEAD_DIM + d, rotated)
            else:
                k = h - q_heads
                tl.store(history_k_ptr + k * hk_head + b * hk_row + position * hk_pos + d,
                         rotated.to(history_k_ptr.dtype.element_ty))
                tl.store(rows_k_ptr + (b * kv_heads + k) * HEAD_DIM + d, rotated.to(rows_k_ptr.dtype.element_ty))
        else:
            v = h - q_heads - kv_heads
            value = x.to(low)
            tl.store(history_v_ptr + v * hv_head + b * hv_row + position * hv_pos + d,
                     value.to(history_v_ptr.dtype.element_ty))
            tl.store(rows_v_ptr + (b * kv_heads + v) * HEAD_DIM + d, value.to(rows_v_ptr.dtype.element_ty))

    @triton.jit
    def silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        low = out_ptr.dtype.element_ty
        gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(low).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (silu * up).to(low), mask=mask)

    return add_rms_norm_kernel, qk_norm_rope_store_kernel, silu_mul_kernel


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class DecodeKernels:
    """The three kernels, compiled on first use. One object per instance (no module-level state)."""

    def __init__(self) -> None:
        if not decode_kernels_available():
            raise DecodeKernelsUnavailable("compute.fused_ops='triton' needs the triton package, which is not importable")
        self._add_rms_norm, self._qk_norm_rope_store, self._silu_mul = _build()
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        #: Built under ``TRITON_INTERPRET=1``: the kernels run in Triton's interpreter and take CPU tensors.
        self.interpreted = isinstance(self._add_rms_norm, InterpretedFunction)
        if self.interpreted and not isinstance(tl.sum, InterpretedFunction):
            raise DecodeKernelsUnavailable(
                "TRITON_INTERPRET=1 was set after triton.language had been imported without it: set it in the "
                "environment before the process imports triton"
            )

    def _check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device.type != "cuda" and not self.interpreted:
                raise DecodeKernelsUnavailable(
                    f"the decode kernels got a {t.device.type} tensor: they run on CUDA, or on the CPU only under "
                    "Triton's interpreter (TRITON_INTERPRET=1)"
                )
            if not t.is_contiguous():
                raise ValueError(f"the decode kernels need contiguous rows; got strides {t.stride()}")

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                     round_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden + delta, rms_norm(hidden + delta) * weight)`` over the last dim (``delta`` None: no add, the
        first output is ``hidden``). ``round_before_weight``: the normalised row is rounded to the activation
        dtype before the weight multiplies it (the Qwen convention), else the weight is applied in fp32."""
        width = hidden.shape[-1]
        self._check(hidden, weight, *(() if delta is None else (delta,)))
        if delta is not None and delta.shape != hidden.shape:
            raise ValueError(f"delta {tuple(delta.shape)} must have hidden's shape {tuple(hidden.shape)}")
        summed = torch.empty_like(hidden) if delta is not None else hidden
        normed = torch.empty_like(hidden)
        block = _next_power_of_two(width)
        self._add_rms_norm[(hidden.numel() // width,)](
            hidden, hidden if delta is None else delta, summed, normed, weight, width, eps,
            HAS_DELTA=delta is not None, ROUND_BEFORE_WEIGHT=round_before_weight, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
        return summed, normed

    def qk_norm_rope_store(self, heads: torch.Tensor, gains: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           eps: float, position: torch.Tensor, history: tuple[torch.Tensor, torch.Tensor],
                           rows: tuple[torch.Tensor, torch.Tensor], *, q_heads: int, kv_heads: int) -> torch.Tensor:
        """One layer's q, k and v from its packed projection ``heads`` (B, 1, q_heads + 2 kv_heads, D):

        q and k: ``rms_norm`` over D, times ``gains`` (q_heads + kv_heads, D), then RoPE
        ``x cos + swap_halves(x) sin`` (``cos``, ``sin`` (B, D), ``sin`` with its first half negated), each op
        rounded to the activation dtype. Returns q (B, q_heads, 1, D); writes k and v into ``history`` (two
        (kv_heads, B, context, D) views, any strides but a contiguous last dim) at each row's ``position`` (B,), and
        into ``rows`` ((B, kv_heads, D) each), what the pool stores after the last layer."""
        batch, _, total, dim = heads.shape
        if total != q_heads + 2 * kv_heads:
            raise ValueError(f"heads has {total} heads; expected q_heads + 2 kv_heads = {q_heads + 2 * kv_heads}")
        if dim & (dim - 1):
            raise DecodeKernelsUnavailable(f"the q/k kernel needs a power-of-two head_dim; got {dim}")
        history_k, history_v = history
        rows_k, rows_v = rows
        for view in (history_k, history_v):
            if view.stride(-1) != 1:
                raise ValueError("the history views need a contiguous head_dim")
        self._check(heads, gains, cos, sin, position, rows_k, rows_v)
        q = torch.empty(batch, q_heads, 1, dim, dtype=heads.dtype, device=heads.device)
        self._qk_norm_rope_store[(batch, total)](
            heads, gains, cos, sin, position, q, history_k, history_v, rows_k, rows_v, q_heads, kv_heads, eps,
            history_k.stride(0), history_k.stride(1), history_k.stride(2),
            history_v.stride(0), history_v.stride(1), history_v.stride(2), HEAD_DIM=dim, num_warps=1,
        )
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` = [gate, up] on the last dim, each op rounded to its dtype."""
        self._check(gate_up)
        width = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, _next_power_of_two(width))
        self._silu_mul[(gate_up.numel() // (2 * width), -(-width // block))](gate_up, out, width, BLOCK=block, num_warps=4)
        return out
