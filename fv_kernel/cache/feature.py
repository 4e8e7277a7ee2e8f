"""The feature cache: content-hash keyed encoder outputs (text / image embeddings), design §7.2.

A byte-budgeted LRU shared by every request on an engine. Entries are immutable
tensors; a hit returns the same tensors, so the same prompt runs the encoder once.
The key carries the encoder's weights version and adapters, so a changed encoder
never serves stale embeddings.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from fv_kernel.cache.keys import CacheKey

__all__ = ["FeatureCache", "CacheStats", "apply_cache_writes"]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


def _nbytes(value: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in value.values())


class FeatureCache:
    """LRU over ``dict[str, Tensor]`` values, bounded by ``budget_bytes``."""

    def __init__(self, budget_bytes: int = 256 * 2**20) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def get(self, key: CacheKey | str) -> dict[str, torch.Tensor] | None:
        """The entry for a key (or its digest), or None."""
        digest = key if isinstance(key, str) else key.digest()
        with self._lock:
            value = self._entries.get(digest)
            if value is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(digest)
            self.stats.hits += 1
            return value

    def put(self, key: CacheKey | str, value: dict[str, torch.Tensor]) -> None:
        size = _nbytes(value)
        if size > self.budget_bytes:
            return  # larger than the whole budget: never cached
        digest = key if isinstance(key, str) else key.digest()
        frozen = {name: tensor.detach() for name, tensor in value.items()}
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._bytes -= _nbytes(old)
            self._entries[digest] = frozen
            self._bytes += size
            while self._bytes > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= _nbytes(evicted)
                self.stats.evictions += 1

    def clear(self) -> None:
        """Drop every entry (after a weights update the versions in new keys differ anyway; this frees memory)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0


def apply_cache_writes(plan_cache: object, outputs: dict[str, torch.Tensor], services: dict[str, object]) -> None:
    """Store a step's outputs as its plan's ``CachePlan.writes`` declare (done by the runtime, not the loop)."""
    for ref in getattr(plan_cache, "writes", ()):
        cache = services.get(ref.cache)
        if cache is None:
            continue
        if ref.output is None:
            value = dict(outputs)
        else:
            tensor = outputs[ref.output]
            value = {ref.output: tensor if ref.index is None else tensor[ref.index : ref.index + 1]}
        cache.put(ref.key, {k: v.detach().clone() for k, v in value.items()})  # type: ignore[attr-defined]
