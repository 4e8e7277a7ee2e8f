"""The engine of a parallel pool's rank 0: the ordinary Engine, with its batches announced.

Scheduling is unchanged (rank 0 alone admits, batches, cancels); what changes is that each
batch's op calls are broadcast to the workers (:class:`~fv_kernel.parallel.spmd.SpmdLeader`)
with the batch's units, and requests are also checked against the plan when submitted
(a shape the sequence split cannot divide is refused before it queues).
"""

from __future__ import annotations

from typing import Any

from fv_kernel.card.refs import import_object
from fv_kernel.parallel.spmd import SpmdLeader
from fv_kernel.request.request import Request
from fv_kernel.runtime.batching import WorkUnit
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.executor import BatchOutcome, Executor

__all__ = ["SpmdEngine", "SpmdExecutor"]


class SpmdExecutor(Executor):
    """An :class:`Executor` that announces each batch's units to the pool's workers before it runs."""

    def __init__(self, *args: Any, leader: SpmdLeader, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.leader = leader

    def run_batch(self, batch: list[WorkUnit]) -> BatchOutcome:
        units = [(u.request_id, u.plan.loop_id, u.plan.step_index) for u in batch]
        with self.leader.batch(units):
            return super().run_batch(batch)


class SpmdEngine(Engine):
    """An :class:`Engine` whose op calls every rank of the pool runs in the same order."""

    def __init__(self, *args: Any, leader: SpmdLeader, **kwargs: Any) -> None:
        self.leader = leader  # before the base builds its executor (make_executor)
        super().__init__(*args, **kwargs)
        if self.config.overlap_kinds:
            # The workers replay rank 0's op calls in one order; two lanes would interleave their collectives.
            raise ValueError("scheduler.overlap_kinds is not supported on a parallel pool (its ranks run one batch "
                             "at a time, in rank 0's order); leave it empty")

    def make_executor(self) -> Executor:
        return SpmdExecutor(
            self._by_instance_id, self.metrics, batching=self.config.batching, check_finite=self.config.check_finite,
            device_thread=self.config.device_thread, leader=self.leader,
        )

    def validate(self, request: Request) -> Request:
        resolved = super().validate(request)
        card = self._instances[resolved.model].card
        if card.parallelism.implementation is not None:
            import_object(card.parallelism.implementation).check_request(card, resolved, self.leader.runtime.plan)
        return resolved
