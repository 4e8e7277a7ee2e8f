"""An Engine observer for the benches: where a run's device time went, op by op."""

from __future__ import annotations

from collections import defaultdict

from fv_kernel.api import Observer, StepRecord

__all__ = ["OpTimes"]


class OpTimes(Observer):
    """Device (else wall) seconds, the largest batch and the count of batches of each size, of every op the
    Engine executed."""

    name = "bench-op-times"

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.largest: dict[str, int] = defaultdict(int)
        #: Per op, batches run of each batch size (JSON-friendly: sizes as strings).
        self.batch_sizes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def on_step(self, record: StepRecord) -> None:
        seconds = record.device_seconds if record.device_seconds is not None else record.wall_seconds
        self.seconds[record.op] += seconds
        self.largest[record.op] = max(self.largest[record.op], record.batch_size)
        self.batch_sizes[record.op][str(record.batch_size)] += 1
