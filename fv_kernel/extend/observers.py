"""Observers: read-only hooks on every executed step (design §11).

Observers see a frozen :class:`StepRecord` after each batched execution; they cannot
mutate loop state or outputs. They are assembled when the engine is built, so an
engine with none pays nothing per step.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fv_kernel.card.spec import StepCostSpec
from fv_kernel.loop.contract import ShapeSignature

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.runtime.cost import CostModel

__all__ = ["StepRecord", "Observer", "Profiler"]


@dataclass(frozen=True)
class StepRecord:
    """One executed batch of steps, as observers see it."""

    instance_id: str
    loop_id: str
    kind: str
    op: str
    shape_sig: ShapeSignature
    precision: str
    request_ids: tuple[str, ...]
    steps: tuple[int, ...]
    wall_seconds: float
    #: Device time when the device can time itself (CUDA events), else None.
    device_seconds: float | None
    predicted_seconds: float
    cost_spec: StepCostSpec
    failed: tuple[str, ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)


class Observer(abc.ABC):
    """Base of the plugin contribution kind ``observers``: read-only step hooks."""

    name: str = "observer"

    @abc.abstractmethod
    def on_step(self, record: StepRecord) -> None:
        """Called after every executed batch. Must not raise; must not mutate anything it is given."""


@dataclass
class _KindStats:
    count: int = 0
    total_seconds: float = 0.0
    total_predicted: float = 0.0


@dataclass
class Profiler(Observer):
    """Per-step wall and device time; calibrates the cost model online (design §6.1)."""

    cost_model: "CostModel"
    name: str = "profiler"
    stats: dict[str, _KindStats] = field(default_factory=dict)

    def on_step(self, record: StepRecord) -> None:
        from fv_kernel.runtime.cost import CostKey

        measured = record.device_seconds if record.device_seconds is not None else record.wall_seconds
        key = CostKey(record.instance_id, record.kind, record.shape_sig, record.precision)
        self.cost_model.observe(key, record.cost_spec, measured, batch_size=record.batch_size)
        entry = self.stats.setdefault(record.kind, _KindStats())
        entry.count += 1
        entry.total_seconds += measured
        entry.total_predicted += record.predicted_seconds

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            kind: {"steps": s.count, "mean_seconds": s.total_seconds / s.count, "mean_predicted": s.total_predicted / s.count}
            for kind, s in self.stats.items() if s.count
        }
