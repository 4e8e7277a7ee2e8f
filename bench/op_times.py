"""An Engine observer for the benches: where a run's device time went, op by op."""

from __future__ import annotations

from collections import defaultdict

from fv_kernel.api import Observer, StepRecord

__all__ = ["OpTimes"]


class OpTimes(Observer):
    """Device (else wall) seconds, the largest batch and the count of batches of each size, of every op the
    Engine executed, and how many rows each call of the op really had."""

    name = "bench-op-times"

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.largest: dict[str, int] = defaultdict(int)
        #: Per op, batches run of each batch size (JSON-friendly: sizes as strings).
        self.batch_sizes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        #: Per op, calls of the op by the rows each held. A scheduled batch is not one call: where the executor
        #: does not fuse (a card without ``parity.batched_vs_alone`` at the instance's precision) its 8 units
        #: are 8 calls of 1 row, which ``batch_sizes`` alone reports as one batch of 8.
        self.call_rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def on_step(self, record: StepRecord) -> None:
        seconds = record.device_seconds if record.device_seconds is not None else record.wall_seconds
        self.seconds[record.op] += seconds
        self.largest[record.op] = max(self.largest[record.op], record.batch_size)
        self.batch_sizes[record.op][str(record.batch_size)] += 1
        fused = sum(record.fused)
        if fused > 1:
            self.call_rows[record.op][str(fused)] += 1
        alone = record.batch_size - (fused if fused > 1 else 0)
        if alone:
            self.call_rows[record.op]["1"] += alone
