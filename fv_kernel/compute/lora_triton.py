"""Triton segmented gather GEMM for per-row LoRA (Punica's SGMV, one segment per batch row).

In a video DiT every token of one batch row (one request) uses the same adapters, so a segment
is a whole row of ``L`` tokens and the per-row update is a few skinny GEMMs per row:

- **shrink**: ``t[e] = x[row(e)] · A[slot(e)]ᵀ`` for every (row, adapter) entry ``e``, ``[L, R]``
  accumulated in fp32 and stored in fp32 (vLLM's shrink buffer);
- **expand**: ``out[row] += Σ_e s_e · c_slot · cast(t[e]) · B[slot(e)]ᵀ`` over the row's entries
  (its stack), accumulated in fp32 and added to ``out`` in one read-modify-write per row, so a
  stack of several adapters costs one pass over ``out``, not one per adapter.

Adapters of different ranks share one launch: their ``A``/``B`` are zero-padded to one rank
block (zeros add nothing). Rows without an entry get no program. The kernels know nothing of
adapters: :class:`fv_kernel.compute.lora.TritonRowKernel` builds the stacks and the routing.
They run on CUDA, or on CPU in Triton's interpreter (``TRITON_INTERPRET=1`` set before the
process imports triton), which is how they are tested without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fv_kernel.errors import FvError

__all__ = ["RowKernelUnavailable", "lora_sgmv", "rank_block", "triton_interpreted"]


class RowKernelUnavailable(FvError, RuntimeError):
    """The per-row LoRA kernel asked for cannot run here (no Triton, or a CPU tensor outside the interpreter)."""

    error_type = "row_kernel_unavailable"


def rank_block(rank: int) -> int:
    """The rank every adapter of one launch is padded to: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << max(0, (rank - 1).bit_length()))


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Build (once per process; Triton compiles lazily, per specialisation) the shrink and expand kernels."""
    import triton
    import triton.language as tl

    @triton.jit
    def shrink(
        x_ptr, a_ptr, t_ptr, entry_row_ptr, entry_slot_ptr, tokens, width_in,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        entry = tl.program_id(0).to(tl.int64)
        m = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row = tl.load(entry_row_ptr + entry).to(tl.int64)
        slot = tl.load(entry_slot_ptr + entry).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        k0 = tl.arange(0, BLOCK_K)
        m_ok = m < tokens
        x_base = x_ptr + row * tokens * width_in
        a_base = a_ptr + slot * BLOCK_R * width_in
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, width_in, BLOCK_K):
            kk = k + k0
            k_ok = kk < width_in
            xt = tl.load(x_base + m[:, None] * width_in + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_base + r[None, :] * width_in + kk[:, None], mask=k_ok[:, None], other=0.0)  # [K, R]: Aᵀ
            acc = tl.dot(xt, at, acc, input_precision=PRECISION)
        t_at = t_ptr + entry * tokens * BLOCK_R + m[:, None] * BLOCK_R + r[None, :]
        tl.store(t_at, acc, mask=m_ok[:, None])

    @triton.jit
    def expand(
        t_ptr, b_ptr, out_ptr, active_row_ptr, row_start_ptr, entry_slot_ptr, entry_scale_ptr, slot_scale_ptr,
        tokens, width_out,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        m = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        n = tl.program_id(2).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        row = tl.load(active_row_ptr + i).to(tl.int64)
        first = tl.load(row_start_ptr + i).to(tl.int64)
        last = tl.load(row_start_ptr + i + 1).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        m_ok = m < tokens
        n_ok = n < width_out
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for entry in range(first, last):  # the row's stack, in order (int64 bounds: int64 offsets)
            slot = tl.load(entry_slot_ptr + entry).to(tl.int64)
            scale = tl.load(entry_scale_ptr + entry) * tl.load(slot_scale_ptr + slot)
            tt = tl.load(t_ptr + entry * tokens * BLOCK_R + m[:, None] * BLOCK_R + r[None, :], mask=m_ok[:, None], other=0.0)
            bt = tl.load(b_ptr + slot * width_out * BLOCK_R + n[None, :] * BLOCK_R + r[:, None], mask=n_ok[None, :], other=0.0)
            # The shrink result rounds to the weights' dtype before the expand, as x·Aᵀ does in eager torch.
            acc += scale * tl.dot(tt.to(bt.dtype), bt, input_precision=PRECISION)
        o_at = out_ptr + row * tokens * width_out + m[:, None] * width_out + n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]
        o = tl.load(o_at, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_at, (o + acc).to(out_ptr.dtype.element_ty), mask=o_mask)

    return shrink, expand


def triton_interpreted() -> bool:
    """Whether the kernels built in this process run in Triton's CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels()[0], InterpretedFunction)


def _require_runnable(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        return
    if not triton_interpreted():
        raise RowKernelUnavailable(
            f"the Triton LoRA kernel got a {x.device.type} tensor: it runs on CUDA, or on CPU only under Triton's "
            "interpreter (TRITON_INTERPRET=1 set before the process imports triton); use kernel='torch' there"
        )
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        raise RowKernelUnavailable(
            "TRITON_INTERPRET=1 was set after triton.language had been imported without it (torch and diffusers "
            "import it): set it in the environment before the process imports triton"
        )


def lora_sgmv(
    x: torch.Tensor,
    out: torch.Tensor,
    downs: torch.Tensor,
    ups: torch.Tensor,
    slot_scales: torch.Tensor,
    entry_rows: torch.Tensor,
    entry_slots: torch.Tensor,
    entry_scales: torch.Tensor,
    active_rows: torch.Tensor,
    row_start: torch.Tensor,
) -> None:
    """``out[row] += Σ_e entry_scales[e] · slot_scales[slot] · (x[row] · downs[slot]ᵀ) · ups[slot]ᵀ``, in place.

    ``x`` ``[rows, L, in]`` and ``out`` ``[rows, L, out]`` contiguous, same dtype; ``downs``
    ``[slots, R, in]`` and ``ups`` ``[slots, out, R]`` in ``x``'s dtype, ``R`` = :func:`rank_block`
    (zero-padded); ``slot_scales`` fp32 ``[slots]`` (each adapter's α/r). Entries sorted by row:
    ``entry_rows``/``entry_slots`` int32 ``[E]``, ``entry_scales`` fp32 ``[E]`` (strengths);
    ``active_rows`` int32 ``[A]`` the rows with entries, whose entries are
    ``row_start[i]:row_start[i + 1]`` (int32 ``[A + 1]``). All on ``x``'s device.
    """
    _require_runnable(x)
    _, tokens, width_in = x.shape
    width_out = out.shape[-1]
    block_r = downs.shape[1]
    if (
        not (x.is_contiguous() and out.is_contiguous() and downs.is_contiguous() and ups.is_contiguous())
        or out.shape[:2] != x.shape[:2]
        or tuple(downs.shape[2:]) != (width_in,)
        or tuple(ups.shape[1:]) != (width_out, block_r)
        or block_r != rank_block(block_r)
    ):
        raise ValueError(
            f"lora_sgmv: x {tuple(x.shape)}, out {tuple(out.shape)}, downs {tuple(downs.shape)}, ups "
            f"{tuple(ups.shape)} do not fit (contiguous [rows, L, in] / [rows, L, out] / [slots, R, in] / [slots, out, R])"
        )
    entries = entry_rows.numel()
    if entries == 0 or tokens == 0:
        return
    shrink, expand = _kernels()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    t = torch.empty(entries, tokens, block_r, dtype=torch.float32, device=x.device)
    block_m = 64 if tokens >= 64 else 16
    shrink[(entries, -(-tokens // block_m))](
        x, downs, t, entry_rows, entry_slots, tokens, width_in,
        BLOCK_M=block_m, BLOCK_K=64 if width_in >= 64 else 16, BLOCK_R=block_r, PRECISION=precision,
    )  # fmt: skip
    block_n = 128 if width_out >= 128 else 16
    expand[(active_rows.numel(), -(-tokens // block_m), -(-width_out // block_n))](
        t, ups, out, active_rows, row_start, entry_slots, entry_scales, slot_scales, tokens, width_out,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=precision,
    )  # fmt: skip
