"""Admission by reservation (design §6.2): nothing starts that cannot finish.

A request is admitted only if its whole-life reservation fits next to every
admitted request: resident memory plus the largest peak activation, cache blocks,
and predicted GPU-seconds within the compute horizon. Two requests that each fit
but would jointly overflow are queued here, never discovered at step 37. Completed
steps draw the compute reservation down; an early finish (EOS, cancellation)
refunds what is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from fv_kernel.errors import CapacityError

__all__ = ["Budgets", "Reservation", "AdmissionController"]


class Budgets(BaseModel):
    """Capacity of one pool. ``None`` means unlimited for that resource."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_bytes: int | None = Field(default=None, gt=0)
    cache_blocks: int | None = Field(default=None, ge=0)
    #: Predicted GPU-seconds of admitted-but-unfinished work; bounds queueing delay inside the pool.
    compute_seconds: float | None = Field(default=None, gt=0)


@dataclass
class Reservation:
    request_id: str
    resident_bytes: int
    peak_bytes: int
    cache_blocks: int
    gpu_seconds: float
    spent_seconds: float = 0.0

    @property
    def remaining_seconds(self) -> float:
        return max(self.gpu_seconds - self.spent_seconds, 0.0)


@dataclass
class AdmissionController:
    """Pure accounting: no clocks, no GPU; unit-testable on its own."""

    budgets: Budgets
    _held: dict[str, Reservation] = field(default_factory=dict)
    admitted_seconds: float = 0.0
    refunded_seconds: float = 0.0
    rejections: dict[str, int] = field(default_factory=dict)

    # -- views --------------------------------------------------------------------
    @property
    def reservations(self) -> dict[str, Reservation]:
        return dict(self._held)

    def memory_in_use(self) -> int:
        if not self._held:
            return 0
        return sum(r.resident_bytes for r in self._held.values()) + max(r.peak_bytes for r in self._held.values())

    def cache_blocks_in_use(self) -> int:
        return sum(r.cache_blocks for r in self._held.values())

    def compute_in_flight(self) -> float:
        return sum(r.remaining_seconds for r in self._held.values())

    # -- decisions ----------------------------------------------------------------
    def why_not(self, want: Reservation) -> str | None:
        """The resource that blocks ``want`` now, or None if it fits."""
        b = self.budgets
        if b.memory_bytes is not None:
            resident = sum(r.resident_bytes for r in self._held.values()) + want.resident_bytes
            peak = max([want.peak_bytes, *(r.peak_bytes for r in self._held.values())])
            if resident + peak > b.memory_bytes:
                return "memory"
        if b.cache_blocks is not None and self.cache_blocks_in_use() + want.cache_blocks > b.cache_blocks:
            return "cache_blocks"
        if b.compute_seconds is not None and self._held and self.compute_in_flight() + want.gpu_seconds > b.compute_seconds:
            # An empty pool always takes one request, however long: the horizon bounds queueing, not size.
            return "compute"
        return None

    def never_fits(self, want: Reservation) -> str | None:
        """The resource ``want`` exceeds even on an empty pool (a request that can never run)."""
        b = self.budgets
        if b.memory_bytes is not None and want.resident_bytes + want.peak_bytes > b.memory_bytes:
            return (f"needs {want.resident_bytes + want.peak_bytes} bytes of memory; "
                    f"the pool has {b.memory_bytes}")
        if b.cache_blocks is not None and want.cache_blocks > b.cache_blocks:
            return f"needs {want.cache_blocks} cache blocks; the pool has {b.cache_blocks}"
        return None

    def try_admit(self, want: Reservation) -> str | None:
        """Reserve ``want`` and return None, or return the blocking resource (and reserve nothing)."""
        if want.request_id in self._held:
            raise ValueError(f"request {want.request_id} is already admitted")
        impossible = self.never_fits(want)
        if impossible is not None:
            raise CapacityError(f"request {want.request_id} {impossible}", param="size")
        reason = self.why_not(want)
        if reason is not None:
            self.rejections[reason] = self.rejections.get(reason, 0) + 1
            return reason
        self._held[want.request_id] = want
        self.admitted_seconds += want.gpu_seconds
        return None

    def charge(self, request_id: str, seconds: float) -> None:
        """Draw down a request's compute reservation as its steps complete."""
        held = self._held.get(request_id)
        if held is not None:
            held.spent_seconds += seconds

    def release(self, request_id: str) -> float:
        """Free everything ``request_id`` holds; returns the refunded (unspent) GPU-seconds."""
        held = self._held.pop(request_id, None)
        if held is None:
            return 0.0
        refund = held.remaining_seconds
        self.refunded_seconds += refund
        return refund
