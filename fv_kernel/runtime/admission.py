"""Admission by reservation (design §6.2): nothing starts that cannot finish.

A request is admitted only if its whole-life reservation fits next to every
admitted request: on its device, resident memory plus the largest peak activation;
blocks of every block pool it draws from, against that pool's real capacity; and
predicted GPU-seconds within the compute horizon. Two requests that each fit but
would jointly overflow are queued here, never discovered at step 37. Completed
steps draw the compute reservation down; an early finish (EOS, cancellation)
refunds what is left.

The controller is pure accounting. The engine tells it each device's memory
capacity (sized from the device when ``Budgets.memory_bytes`` is ``"auto"``) and
registers each resident instance's block pools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator

from fv_kernel.errors import CapacityError

__all__ = ["Budgets", "Reservation", "AdmissionController", "parse_bytes"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_bytes(text: str) -> int:
    """``"40GiB"`` -> 42949672960; plain digits are bytes. Raises ValueError naming the accepted forms."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size; write bytes (e.g. 42949672960) or a number with a unit "
                         f"({', '.join(u for u in _UNITS if u)}), e.g. '40GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


class Budgets(BaseModel):
    """What admission may reserve (the ``scheduler.budgets`` section of the deploy config).

    Memory is on by default and sized from each device the engine serves. Each block
    pool of a resident instance is always a budget of its own: its real capacity.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Bytes the admitted requests may reserve on each device. ``"auto"`` (the default):
    #: the device's total memory times ``1 - memory_headroom``, minus what the resident
    #: instances on it keep (weights, block pools). A number (bytes, or a size such as
    #: ``"40GiB"``) is used as is. ``"unlimited"`` (or null) turns the memory budget off.
    memory_bytes: PositiveInt | Literal["auto", "unlimited"] = "auto"
    #: Fraction of a device's total memory ``"auto"`` leaves unreserved (CUDA context,
    #: allocator fragmentation, library workspaces, compiled graphs).
    memory_headroom: float = Field(default=0.1, ge=0.0, lt=1.0)
    #: Blocks of unnamed caches (``ResourceRequest.cache_blocks``) all admitted requests may
    #: hold; None: no limit. Named block pools are bounded by their own capacity.
    cache_blocks: NonNegativeInt | None = None
    #: Predicted GPU-seconds of admitted-but-unfinished work; bounds queueing delay inside the
    #: pool. None: no limit.
    compute_seconds: PositiveFloat | None = None

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory_size(cls, value: Any) -> Any:
        if value is None:
            return "unlimited"
        if isinstance(value, str) and value not in ("auto", "unlimited"):
            try:
                return parse_bytes(value)
            except ValueError as exc:
                raise ValueError(f"{exc}; or 'auto' (size from the device) or 'unlimited'") from None
        return value

    @property
    def fixed_memory_bytes(self) -> int | None:
        """The explicit per-device memory budget, or None ("auto" or "unlimited")."""
        return self.memory_bytes if isinstance(self.memory_bytes, int) else None


#: The device key of reservations made without one (pure accounting, tests).
DEFAULT_DEVICE = "default"


@dataclass
class Reservation:
    """What one admitted request holds until it ends."""

    request_id: str
    resident_bytes: int
    peak_bytes: int
    cache_blocks: int
    gpu_seconds: float
    spent_seconds: float = 0.0
    #: Blocks per block pool, by the pool's engine-wide key (``"<instance id>/<pool>"``).
    pool_blocks: dict[str, int] = field(default_factory=dict)
    #: The device the bytes are reserved on (``"cuda:0"``, ``"cpu"``).
    device: str = DEFAULT_DEVICE
    #: The adapter versions the request uses, with their bytes on the device. Requests share an
    #: adapter's copy, so each version is counted once per device however many hold it.
    adapters: dict[str, int] = field(default_factory=dict)

    @property
    def remaining_seconds(self) -> float:
        return max(self.gpu_seconds - self.spent_seconds, 0.0)

    @property
    def memory_bytes(self) -> int:
        return self.resident_bytes + self.peak_bytes


@dataclass
class AdmissionController:
    """Pure accounting: no clocks, no GPU; unit-testable on its own."""

    budgets: Budgets
    _held: dict[str, Reservation] = field(default_factory=dict)
    admitted_seconds: float = 0.0
    refunded_seconds: float = 0.0
    rejections: dict[str, int] = field(default_factory=dict)
    #: Memory capacity per device as the engine sized it (``"auto"``), with how it was derived.
    _memory: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: Capacity in blocks of every registered block pool, by engine-wide key.
    _pools: dict[str, int] = field(default_factory=dict)
    #: Bytes the adapters in use may take per device (``adapters.device_budget_bytes``).
    _adapter_capacity: dict[str, int] = field(default_factory=dict)

    # -- capacity ------------------------------------------------------------------
    def set_memory_capacity(self, device: str, capacity_bytes: int, basis: str = "") -> None:
        """The bytes requests may reserve on ``device`` (``basis`` explains the figure in errors)."""
        self._memory[device] = (capacity_bytes, basis)

    def memory_limit(self, device: str = DEFAULT_DEVICE) -> int | None:
        """Bytes requests may reserve on ``device``; None: no memory budget there."""
        if self.budgets.memory_bytes == "unlimited":
            return None
        sized = self._memory.get(device)
        if sized is not None:
            return sized[0]
        return self.budgets.fixed_memory_bytes

    def _memory_basis(self, device: str) -> str:
        sized = self._memory.get(device)
        if sized is not None and sized[1]:
            return f" ({sized[1]})"
        return " (scheduler.budgets.memory_bytes)" if self.budgets.fixed_memory_bytes is not None else ""

    def set_adapter_capacity(self, device: str, capacity_bytes: int) -> None:
        """The bytes the adapters of admitted requests may take on ``device`` together."""
        self._adapter_capacity[device] = capacity_bytes

    def adapter_bytes_in_use(self, device: str, extra: Reservation | None = None) -> int:
        """Bytes of the distinct adapter versions the admitted requests (and ``extra``) use on ``device``."""
        versions: dict[str, int] = {}
        for r in self._on(device) + ([extra] if extra is not None else []):
            versions.update(r.adapters)
        return sum(versions.values())

    def register_pool(self, key: str, capacity_blocks: int) -> None:
        """Make a block pool part of admission: its blocks are reserved against ``capacity_blocks``."""
        if key in self._pools:
            raise ValueError(f"block pool {key!r} is already registered")
        self._pools[key] = capacity_blocks

    @property
    def pools(self) -> dict[str, int]:
        return dict(self._pools)

    # -- views --------------------------------------------------------------------
    @property
    def reservations(self) -> dict[str, Reservation]:
        return dict(self._held)

    def _on(self, device: str | None) -> list[Reservation]:
        return [r for r in self._held.values() if device is None or r.device == device]

    def resident_in_use(self, device: str | None = None) -> int:
        """Residents' bytes on ``device`` (all when None), with each adapter version in use once."""
        devices = {r.device for r in self._held.values()} if device is None else {device}
        return sum(r.resident_bytes for r in self._on(device)) + sum(self.adapter_bytes_in_use(d) for d in devices)

    def memory_in_use(self, device: str | None = None) -> int:
        """Reserved bytes on ``device`` (all devices when None): every resident plus the largest peak."""
        devices = {r.device for r in self._held.values()} if device is None else {device}
        total = 0
        for d in devices:
            held = self._on(d)
            if held:
                total += self.resident_in_use(d) + max(r.peak_bytes for r in held)
        return total

    def peak_headroom(self) -> int | None:
        """Bytes free for transient peaks on the tightest budgeted device (what a batch's summed peaks may use)."""
        devices = {r.device for r in self._held.values()} | set(self._memory) | {DEFAULT_DEVICE}
        free = [limit - self.resident_in_use(d) for d in devices if (limit := self.memory_limit(d)) is not None]
        return max(min(free), 0) if free else None

    def cache_blocks_in_use(self) -> int:
        return sum(r.cache_blocks for r in self._held.values())

    def pool_blocks_in_use(self, key: str) -> int:
        return sum(r.pool_blocks.get(key, 0) for r in self._held.values())

    def compute_in_flight(self) -> float:
        return sum(r.remaining_seconds for r in self._held.values())

    # -- decisions ----------------------------------------------------------------
    def why_not(self, want: Reservation) -> str | None:
        """The resource that blocks ``want`` now, or None if it fits."""
        b = self.budgets
        adapter_capacity = self._adapter_capacity.get(want.device)
        if want.adapters and adapter_capacity is not None and self.adapter_bytes_in_use(want.device, want) > adapter_capacity:
            return "adapter_memory"
        limit = self.memory_limit(want.device)
        if limit is not None:
            held = self._on(want.device)
            # Adapters in use sit beside the residents (each version once).
            resident = sum(r.resident_bytes for r in held) + want.resident_bytes + self.adapter_bytes_in_use(want.device, want)
            peak = max([want.peak_bytes, *(r.peak_bytes for r in held)])
            if resident + peak > limit:
                return "memory"
        for key, blocks in want.pool_blocks.items():
            if self.pool_blocks_in_use(key) + blocks > self._pool_capacity(key):
                return "pool_blocks"
        if b.cache_blocks is not None and self.cache_blocks_in_use() + want.cache_blocks > b.cache_blocks:
            return "cache_blocks"
        if b.compute_seconds is not None and self._held and self.compute_in_flight() + want.gpu_seconds > b.compute_seconds:
            # An empty pool always takes one request, however long: the horizon bounds queueing, not size.
            return "compute"
        return None

    def _pool_capacity(self, key: str) -> int:
        try:
            return self._pools[key]
        except KeyError:
            raise ValueError(f"block pool {key!r} is not registered; registered: {sorted(self._pools)}") from None

    def never_fits(self, want: Reservation) -> str | None:
        """The resource ``want`` exceeds even with nothing else admitted (a request that can never run)."""
        b = self.budgets
        adapter_capacity = self._adapter_capacity.get(want.device)
        adapter_bytes = sum(want.adapters.values())
        if adapter_capacity is not None and adapter_bytes > adapter_capacity:
            return (f"needs {adapter_bytes} bytes of adapters on {want.device} ({len(want.adapters)} adapter version(s)); "
                    f"the adapter budget there is {adapter_capacity} bytes (adapters.device_budget_bytes)")
        limit = self.memory_limit(want.device)
        if limit is not None and want.memory_bytes + adapter_bytes > limit:
            return (f"needs {want.memory_bytes + adapter_bytes} bytes of memory on {want.device} (resident "
                    f"{want.resident_bytes} + peak {want.peak_bytes} + adapters {adapter_bytes}); the budget there is "
                    f"{limit} bytes{self._memory_basis(want.device)}")
        for key, blocks in want.pool_blocks.items():
            capacity = self._pool_capacity(key)
            if blocks > capacity:
                return f"needs {blocks} blocks of block pool {key!r}; the pool has {capacity}"
        if b.cache_blocks is not None and want.cache_blocks > b.cache_blocks:
            return (f"needs {want.cache_blocks} cache blocks; the budget is {b.cache_blocks} "
                    "(scheduler.budgets.cache_blocks)")
        return None

    def try_admit(self, want: Reservation) -> str | None:
        """Reserve ``want`` and return None, or return the blocking resource (and reserve nothing)."""
        if want.request_id in self._held:
            raise ValueError(f"request {want.request_id} is already admitted")
        impossible = self.never_fits(want)
        if impossible is not None:
            raise CapacityError(f"request {want.request_id} {impossible}", param="adapters" if "adapters.device_budget" in impossible else "size")
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
