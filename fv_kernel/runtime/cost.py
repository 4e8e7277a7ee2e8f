"""The cost model: every WorkUnit priced in predicted GPU-seconds (design §6.1).

One object with a stable interface, so the scheduler's budget and a fleet router's
input are the same thing. Predictions come from the loop's declared
:class:`~fv_kernel.card.spec.StepCostSpec`; the Profiler calibrates them online with a
per-(instance, kind, shape, precision) correction factor. A shape not measured yet
borrows the factor learnt on its (instance, kind, precision): how wrong a declared
spec is carries over between shapes far better than not at all. Admission always
uses the conservative price, for whole requests too (:meth:`CostModel.price`, over
the steps a loop's estimate describes); calibration refines, it never licenses
optimism below the declared floor of the correction.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fv_kernel.card.spec import StepCostSpec
from fv_kernel.extend.observers import Observer, StepRecord
from fv_kernel.loop.plan import ShapeSignature, StepEstimate

__all__ = ["CostModel", "CostKey", "Profiler"]


@dataclass(frozen=True)
class CostKey:
    """What a calibration factor is kept per: instance, step kind, shape and precision."""

    instance_id: str
    kind: str
    shape_sig: ShapeSignature
    precision: str

    def __hash__(self) -> int:  # the shape's dims tuple hashes far faster than the pydantic model
        return hash((self.instance_id, self.kind, self.shape_sig.dims, self.precision))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CostKey) and (self.instance_id, self.kind, self.shape_sig.dims, self.precision) == (
            other.instance_id, other.kind, other.shape_sig.dims, other.precision)


class CostModel:
    """Predicts step time and learns from measured step time.

    ``alpha`` is the EMA weight of a new observation. The correction factor is
    clamped to ``[min_factor, max_factor]`` so one outlier cannot make admission
    wildly optimistic or starve the pool.
    """

    def __init__(self, *, alpha: float = 0.2, min_factor: float = 0.05, max_factor: float = 50.0) -> None:
        self._alpha = alpha
        self._min = min_factor
        self._max = max_factor
        self._factor: dict[CostKey, float] = {}
        #: The same correction per (instance, kind, precision), over every shape measured.
        self._kind_factor: dict[tuple[str, str, str], float] = {}
        # Uncalibrated per-step prices, memoised: specs are immutable and shapes repeat every step.
        self._base: dict[tuple[int, CostKey], float] = {}
        self._samples: dict[CostKey, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def base_seconds(spec: StepCostSpec, shape_sig: ShapeSignature, precision: str, batch_size: int = 1) -> float:
        units = float(shape_sig.get(spec.unit, 0) or 0)
        per_item = spec.fixed_seconds + spec.per_unit_seconds * units + spec.per_unit_sq_seconds * units * units
        # A step of ``repeat`` sub-steps (multi-step decode) costs that many of its shape.
        return per_item * shape_sig.repeat * spec.precision_factor.get(precision, 1.0) * max(batch_size, 1)

    def predict(self, key: CostKey, spec: StepCostSpec, batch_size: int = 1) -> float:
        """Calibrated expected GPU-seconds of a step (or a batch of ``batch_size`` of them)."""
        base = self._base.get((id(spec), key))
        if base is None:
            base = self._base[(id(spec), key)] = self.base_seconds(spec, key.shape_sig, key.precision, 1)
        return base * max(batch_size, 1) * self.factor(key)

    def conservative(self, key: CostKey, spec: StepCostSpec, batch_size: int = 1) -> float:
        """The price admission reserves: the prediction times the spec's safety factor."""
        return self.predict(key, spec, batch_size) * spec.conservative_factor

    def price(self, instance_id: str, step: StepEstimate, spec: StepCostSpec) -> float:
        """What admission reserves for ``step.count`` steps a loop's estimate describes."""
        key = CostKey(instance_id, step.kind.value, step.shape_sig, step.precision)
        return self.conservative(key, spec) * step.count

    def observe(self, key: CostKey, spec: StepCostSpec, measured_seconds: float, batch_size: int = 1) -> None:
        """Fold a measured step time into the key's correction factor (and its kind's)."""
        base = self.base_seconds(spec, key.shape_sig, key.precision, batch_size)
        if base <= 0 or measured_seconds < 0:
            return
        ratio = min(max(measured_seconds / base, self._min), self._max)
        kind = (key.instance_id, key.kind, key.precision)
        with self._lock:
            old = self._factor.get(key)
            self._factor[key] = ratio if old is None else (1 - self._alpha) * old + self._alpha * ratio
            self._samples[key] = self._samples.get(key, 0) + 1
            old_kind = self._kind_factor.get(kind)
            self._kind_factor[kind] = ratio if old_kind is None else (1 - self._alpha) * old_kind + self._alpha * ratio

    def factor(self, key: CostKey) -> float:
        """The key's correction: its own once measured, else its kind's, else 1 (the declared spec)."""
        own = self._factor.get(key)
        if own is not None:
            return own
        return self._kind_factor.get((key.instance_id, key.kind, key.precision), 1.0)

    def samples(self, key: CostKey) -> int:
        return self._samples.get(key, 0)

    def snapshot(self) -> list[dict[str, object]]:
        """The calibration table, for export (fleet routing, metrics)."""
        return [
            {"instance_id": k.instance_id, "kind": k.kind, "shape": str(k.shape_sig), "precision": k.precision,
             "factor": f, "samples": self._samples.get(k, 0)}
            for k, f in self._factor.items()
        ]


@dataclass
class _KindStats:
    count: int = 0
    total_seconds: float = 0.0
    total_predicted: float = 0.0


@dataclass
class Profiler(Observer):
    """Per-step wall and device time; calibrates the cost model online (design §6.1)."""

    cost_model: CostModel
    name: str = "profiler"
    stats: dict[str, _KindStats] = field(default_factory=dict)

    def on_step(self, record: StepRecord) -> None:
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
