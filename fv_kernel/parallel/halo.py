"""Halo exchange for spatially split convolutions (parallel VAE decode).

A tensor split into equal strips along ``dim`` over a group (strip index = rank) is
extended by ``width`` rows from each neighbour, or zeros at the outer edges, which is
exactly the zero padding a whole-tensor convolution would see there. A convolution with
no padding along ``dim`` on the extended strip then gives this rank's rows of the
whole-tensor convolution.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["halo_exchange"]


def halo_exchange(x: torch.Tensor, dim: int, width: int, group: Any) -> torch.Tensor:
    """``x`` with ``width`` neighbour rows (zeros at the edges) before and after it along ``dim``."""
    if width == 0:
        return x
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    length = x.shape[dim]
    if length < width:
        raise ValueError(f"a strip of {length} rows cannot give a halo of {width}: use fewer ranks or a larger input")
    first = x.narrow(dim, 0, width).contiguous()
    last = x.narrow(dim, length - width, width).contiguous()
    before, after = torch.zeros_like(first), torch.zeros_like(last)
    ops = []
    if rank > 0:
        peer = dist.get_global_rank(group, rank - 1)
        ops += [dist.P2POp(dist.isend, first, peer, group=group), dist.P2POp(dist.irecv, before, peer, group=group)]
    if rank < size - 1:
        peer = dist.get_global_rank(group, rank + 1)
        ops += [dist.P2POp(dist.isend, last, peer, group=group), dist.P2POp(dist.irecv, after, peer, group=group)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return torch.cat([before, x, after], dim=dim)
