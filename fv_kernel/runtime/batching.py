"""WorkUnits and the BatchScheduler (design §6.3).

Every ``await ctx.execute(plan)`` becomes a :class:`WorkUnit`. The batch scheduler
groups compatible units of different requests (same instance, kind, op, shape
signature, precision, graph key and params) into one execution and picks which
group runs next:

- the group holding the unit that has waited longest runs first (running loops
  are never starved: a long denoise loop re-enqueues one unit per step and that
  unit ages while short AR units keep arriving, so it wins within one round);
- interactive requests go before batch-class ones unless the batch unit has waited
  longer than ``batch_class_max_wait_s``;
- non-batchable plans, and plans whose predicted price exceeds ``jumbo_seconds``,
  run as batch-of-1 ("jumbo" steps);
- a waiting jumbo step is never delayed by more than ``max_interleave_ratio`` times
  its own price of other work since the last jumbo step ran: interleaving short
  image and AR steps slows a long video loop by at most that fraction.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fv_kernel.loop.plan import StepResult, WorkPlan

__all__ = ["WorkUnit", "BatchPolicy", "BatchScheduler"]

@dataclass(eq=False)
class WorkUnit:
    """A plan waiting to run, with the future its driver awaits."""

    plan: WorkPlan
    request_id: str
    future: "asyncio.Future[StepResult]"
    enqueued_at: float
    price_seconds: float
    priority: str = "interactive"
    #: Arrival order, assigned by the engine; breaks ties between equal timestamps.
    seq: int = 0
    #: The request must be bit-identical to itself run alone: its rows never share a fused call
    #: of an op that is not batch-invariant (``Request.exact``, behaviour capture).
    exact: bool = False

    def __post_init__(self) -> None:
        # Computed once: the batch scheduler compares keys of every pending unit on every pick.
        self.key: tuple[Any, ...] = self.plan.batch_key()


class BatchPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(default=32, ge=1)
    #: A single step predicted to take longer than this stays batch-of-1 (jumbo video steps).
    jumbo_seconds: float | None = Field(default=None, gt=0)
    #: Per-kind caps on batch size (e.g. {"diffusion_step": 8}).
    kind_max_batch: dict[str, int] = Field(default_factory=dict)
    batch_class_max_wait_s: float = Field(default=5.0, ge=0)
    #: Other work allowed between two jumbo steps, as a fraction of the jumbo step's price.
    max_interleave_ratio: float = Field(default=0.2, ge=0)


class BatchScheduler:
    """Pure selection logic over pending units; unit-testable without a runtime."""

    def __init__(self, policy: BatchPolicy | None = None) -> None:
        self.policy = policy or BatchPolicy()
        #: Device seconds of non-jumbo work executed since the last jumbo step.
        self._since_jumbo = 0.0

    def note_executed(self, batch: list[WorkUnit], seconds: float) -> None:
        """Account an executed batch (the engine calls this after every execution)."""
        if batch and self._solo(batch[0]):
            self._since_jumbo = 0.0
        else:
            self._since_jumbo += seconds

    def _solo(self, unit: WorkUnit) -> bool:
        jumbo = self.policy.jumbo_seconds
        return not unit.plan.batchable or (jumbo is not None and unit.price_seconds > jumbo)

    def _rank(self, unit: WorkUnit, now: float) -> tuple[int, float, int]:
        batch_class_waiting_long = (
            unit.priority == "batch" and now - unit.enqueued_at > self.policy.batch_class_max_wait_s
        )
        klass = 0 if unit.priority == "interactive" or batch_class_waiting_long else 1
        return (klass, unit.enqueued_at, unit.seq)

    def select(
        self, pending: list[WorkUnit], now: float, *, peak_headroom: int | None = None, head_must_fit: bool = False,
    ) -> list[WorkUnit]:
        """The next batch to execute, in a deterministic order (non-empty if ``pending`` is, unless
        ``head_must_fit``).

        ``peak_headroom`` bounds the summed peak activation bytes of the batch; the
        first unit is always taken (its request was admitted with its peak reserved), unless
        ``head_must_fit``: another batch runs beside this one, and a first unit whose peak does
        not fit the headroom waits (an empty batch).
        """
        if not pending:
            return []
        head = min(pending, key=lambda u: self._rank(u, now))
        jumbos = [u for u in pending if self._solo(u)]
        if jumbos and not self._solo(head):
            oldest_jumbo = min(jumbos, key=lambda u: self._rank(u, now))
            if self._since_jumbo >= self.policy.max_interleave_ratio * oldest_jumbo.price_seconds:
                head = oldest_jumbo
        if head_must_fit and peak_headroom is not None and head.plan.resources.peak_bytes > peak_headroom:
            return []
        if self._solo(head):
            return [head]
        cap = min(self.policy.max_batch_size, self.policy.kind_max_batch.get(head.plan.kind.value, self.policy.max_batch_size))
        mates = sorted(
            (u for u in pending if u is not head and u.key == head.key and not self._solo(u)),
            key=lambda u: self._rank(u, now),
        )
        batch = [head]
        peak = head.plan.resources.peak_bytes
        seen_requests = {head.request_id}
        for unit in mates:
            if len(batch) >= cap:
                break
            if unit.request_id in seen_requests:  # one unit per request per batch keeps per-request order
                continue
            if peak_headroom is not None and peak + unit.plan.resources.peak_bytes > peak_headroom:
                continue
            batch.append(unit)
            peak += unit.plan.resources.peak_bytes
            seen_requests.add(unit.request_id)
        return batch
