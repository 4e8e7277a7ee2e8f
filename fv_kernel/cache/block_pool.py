"""What admission and metrics need from an instance's block pool, whatever kind it is.

The paged text-KV pool (``PagedKVPool``) and the slab chunk-KV pool (``SlabKVPool``) both
satisfy :class:`BlockPool`: the engine registers ``capacity_blocks`` with admission, the
capacity plan counts ``capacity_bytes`` as resident, and ``/metrics`` reports
``used_blocks``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["BlockPool"]


@runtime_checkable
class BlockPool(Protocol):
    """A fixed budget of equal blocks that admission reserves by name."""

    @property
    def capacity_blocks(self) -> int: ...

    @property
    def used_blocks(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def capacity_bytes(self) -> int: ...
