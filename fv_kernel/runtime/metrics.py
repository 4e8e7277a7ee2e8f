"""The engine's counters, exported by the serving layer (Prometheus)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

__all__ = ["EngineMetrics"]


@dataclass
class EngineMetrics:
    """Counters the serving layer exports (Prometheus)."""

    units_by_kind: dict[str, int] = field(default_factory=dict)
    batches_by_size: dict[int, int] = field(default_factory=dict)
    step_latency_buckets: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, math.inf)
    step_latency_counts: list[int] = field(default_factory=lambda: [0] * 10)
    step_latency_sum: float = 0.0
    step_latency_count: int = 0
    #: The scheduler's own host time: admission, choosing each batch, and handing its results back.
    scheduler_seconds: float = 0.0
    #: Time the scheduler yields before choosing a batch so that the drivers the last batch woke post
    #: their next plans: the loops' own host code (advance, next, finalize), not the scheduler's.
    loop_host_seconds: float = 0.0
    execute_seconds: float = 0.0
    #: Batches started on one device lane while the other lane's batch ran (``scheduler.overlap_kinds``).
    overlapped_batches: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    #: Fused (throughput-mode) batches that raised and were re-run per request, by op.
    fused_fallbacks: dict[str, int] = field(default_factory=dict)
    #: Fused calls (rows of several requests in one call of an op), by how many requests' rows each held.
    fused_calls_by_size: dict[int, int] = field(default_factory=dict)
    #: Adapter weight transitions (a stack merged into, or restored out of, a component) and their seconds.
    adapter_transitions: int = 0
    adapter_transition_seconds: float = 0.0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    #: Guards the counters the device threads add to. With a second lane two threads run batches at
    #: once, and ``count += 1`` is a read, an add and a write that their threads may interleave.
    _device_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def note_adapter_transition(self, seconds: float) -> None:
        """One adapter weight transition of ``seconds`` (called on a device thread)."""
        with self._device_lock:
            self.adapter_transitions += 1
            self.adapter_transition_seconds += seconds

    def note_fused_fallback(self, op: str) -> None:
        """A fused call of ``op`` raised and its rows were re-run one by one (called on a device thread)."""
        with self._device_lock:
            self.fused_fallbacks[op] = self.fused_fallbacks.get(op, 0) + 1

    def observe_latency(self, seconds: float) -> None:
        for i, bound in enumerate(self.step_latency_buckets):
            if seconds <= bound:
                self.step_latency_counts[i] += 1
        self.step_latency_sum += seconds
        self.step_latency_count += 1
