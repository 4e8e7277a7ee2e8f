"""An Engine observer for the benches: where a run's device time went, op by op."""

from __future__ import annotations

from collections import defaultdict

from fv_kernel.api import Observer, StepRecord

__all__ = ["OpTimes"]


class OpTimes(Observer):
    """Device (else wall) seconds and the largest batch of every op the Engine executed."""

    name = "bench-op-times"

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.largest: dict[str, int] = defaultdict(int)

    def on_step(self, record: StepRecord) -> None:
        seconds = record.device_seconds if record.device_seconds is not None else record.wall_seconds
        self.seconds[record.op] += seconds
        self.largest[record.op] = max(self.largest[record.op], record.batch_size)
