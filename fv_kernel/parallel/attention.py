"""Sequence-parallel attention over torch.distributed: Ulysses, ring, and the two combined (USP).

Layout: the token sequence is split into ``sp = ring x ulysses`` equal chunks; the rank at
ring index ``r`` and Ulysses index ``u`` holds chunk ``r * ulysses + u`` (the flattened
``sp`` group's rank). Tensors are ``(B, heads, L_local, head_dim)`` as attention
backends take them.

* **Ulysses** (DeepSpeed-Ulysses): an all-to-all turns "all heads, my tokens" into "my
  heads, all tokens" of the Ulysses group; attention runs on whole sequences with the
  deployment's own backend; a second all-to-all turns it back. Needs ``heads % ulysses == 0``.
* **Ring**: each rank keeps its queries and passes its K/V block around the ring; partial
  outputs merge exactly through their log-sum-exp (online softmax). The partial attention
  is computed in fp32 by matmuls here (it needs the LSE, which the generic backend
  callable does not return), so ring is exact everywhere but not a fast GPU kernel.
* **USP** (Fang & Zhao, 2024): Ulysses inside, ring across: after the Ulysses exchange a
  rank holds ring block ``r`` for its heads, and the ring runs over those blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ulysses_seq_to_heads",
    "ulysses_heads_to_seq",
    "ring_attention",
    "SequenceParallelAttention",
    "shard_sequence",
    "gather_sequence",
]

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def ulysses_seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(B, H, L/P, D) sequence-sharded -> (B, H/P, L, D) head-sharded over ``group``."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    batch, heads, local, dim = x.shape
    send = x.reshape(batch, size, heads // size, local, dim).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * local, dim)


def ulysses_heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(B, H/P, L, D) head-sharded -> (B, H, L/P, D) sequence-sharded over ``group``."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    batch, heads_local, length, dim = x.shape
    local = length // size
    send = x.reshape(batch, heads_local, size, local, dim).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's heads of my tokens
    return recv.permute(1, 0, 2, 3, 4).reshape(batch, size * heads_local, local, dim)


#: fp32 score elements one query chunk of the ring's partial attention may hold (256 MiB).
_SCORE_ELEMENTS = 64 * 2**20


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one K/V block in fp32, with its log-sum-exp (B, H, Lq, 1).

    Queries go in chunks so the fp32 score matrix stays within ``_SCORE_ELEMENTS`` (at real
    sizes a whole block's scores would not fit: 14B at ring 2 is ~230 GB); query rows are
    independent, so chunking changes only the matmuls' rounding.
    """
    scale = q.shape[-1] ** -0.5
    batch, heads, length, _ = q.shape
    rows = max(1, _SCORE_ELEMENTS // max(1, batch * heads * k.shape[-2]))
    key_t, value = k.float().transpose(-1, -2), v.float()
    outs, lses = [], []
    for start in range(0, length, rows):
        scores = torch.matmul(q[:, :, start : start + rows].float(), key_t) * scale
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        outs.append(torch.matmul(torch.exp(scores - lse), value))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any) -> torch.Tensor:
    """Exact attention of local queries against the K/V blocks of every rank of ``group``."""
    size = dist.get_world_size(group)
    if size == 1:
        out, _ = _attend_with_lse(q, k, v)
        return out.to(q.dtype)
    rank = dist.get_rank(group)
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    recv_from = dist.get_global_rank(group, (rank - 1) % size)
    block = torch.stack([k, v]).contiguous()
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(size):
        pending = []
        incoming = None
        if step < size - 1:  # pass the block on while this one is computed
            incoming = torch.empty_like(block)
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, block, send_to, group=group),
                dist.P2POp(dist.irecv, incoming, recv_from, group=group),
            ])
        part, part_lse = _attend_with_lse(q, block[0], block[1])
        if out is None or lse is None:
            out, lse = part, part_lse
        else:
            merged = torch.logaddexp(lse, part_lse)
            out = out * torch.exp(lse - merged) + part * torch.exp(part_lse - merged)
            lse = merged
        for work in pending:
            work.wait()
        if incoming is not None:
            block = incoming
    assert out is not None
    return out.to(q.dtype)


class SequenceParallelAttention:
    """The self-attention callable of a sequence-parallel forward: USP over the two groups.

    ``local_fn`` (the deployment's attention backend) runs whole-sequence attention when
    there is no ring; with a ring the LSE path of :func:`ring_attention` runs instead.
    """

    def __init__(self, ulysses_group: Any, ring_group: Any, local_fn: AttentionFn) -> None:
        self.ulysses_group, self.ring_group, self.local_fn = ulysses_group, ring_group, local_fn
        self.ulysses = dist.get_world_size(ulysses_group)
        self.ring = dist.get_world_size(ring_group)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (ulysses_seq_to_heads(t, self.ulysses_group) for t in (q, k, v))
        if self.ring > 1:
            out = ring_attention(q, k, v, self.ring_group)
        else:
            out = self.local_fn(q, k, v)
        return ulysses_heads_to_seq(out, self.ulysses_group)


def shard_sequence(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's equal chunk of ``x`` along ``dim`` (chunk index = rank in ``group``)."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def gather_sequence(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` in rank order (the inverse of :func:`shard_sequence`)."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
