"""Observers: read-only hooks on every executed step (design §11).

Observers see a frozen :class:`StepRecord` after each batched execution; they cannot
mutate loop state or outputs. They are assembled when the engine is built, so an
engine with none pays nothing per step.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fv_kernel.errors import NonFiniteOutput

from fv_kernel.card.spec import StepCostSpec
from fv_kernel.loop.plan import ShapeSignature

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.extend.interceptors import BlockCall

__all__ = ["StepRecord", "Observer", "BlockObserver", "NaNWatch", "ParityAligner", "Divergence"]


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
    #: One per request: whether its rows ran inside the batch's one fused call (else on their own).
    fused: tuple[bool, ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)


class Observer(abc.ABC):
    """Base of the plugin contribution kind ``observers``: read-only step hooks."""

    name: str = "observer"

    @abc.abstractmethod
    def on_step(self, record: StepRecord) -> None:
        """Called after every executed batch. Must not raise; must not mutate anything it is given."""


class BlockObserver(Observer):
    """A read-only hook on every transformer block of the steps it sees.

    It runs inside a family's step op (through :class:`~fv_kernel.extend.hooks.BlockHooks`)
    and must not modify ``hidden``. Raising aborts that request's step only.
    """

    def on_step(self, record: StepRecord) -> None:
        return None

    @abc.abstractmethod
    def on_block(self, call: "BlockCall", index: int, hidden: torch.Tensor) -> None:
        """Called with block ``index``'s output for one row of one step."""


@dataclass
class NaNWatch(BlockObserver):
    """Localises the first NaN/Inf: names the loop, step, guidance branch and block, and aborts that request."""

    name: str = "nanwatch"

    def on_block(self, call: "BlockCall", index: int, hidden: torch.Tensor) -> None:
        if not bool(torch.isfinite(hidden).all()):
            raise NonFiniteOutput(
                f"first NaN/Inf in loop {call.loop_id!r} at step {call.step_index}, branch {call.branch!r}, "
                f"after block {index}",
                param="block",
            )


@dataclass(frozen=True)
class Divergence:
    tap: str
    max_abs_diff: float
    tolerance: float


@dataclass
class ParityAligner(BlockObserver):
    """Records named taps (``"<loop>/step<k>/<branch>/block<i>"``) per request.

    In record mode it keeps every tap; in compare mode (``reference`` given) it also
    reports, per request, the first tap whose max abs diff exceeds ``tolerance``.
    Taps are copied to CPU float32, so turn it on for debugging and gates, not serving.
    """

    reference: dict[str, torch.Tensor] | None = None
    tolerance: float = 0.0
    name: str = "parity_aligner"
    _taps: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    _first: dict[str, Divergence] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @staticmethod
    def tap_name(call: "BlockCall", index: int) -> str:
        return f"{call.loop_id}/step{call.step_index}/{call.branch}/block{index}"

    def on_block(self, call: "BlockCall", index: int, hidden: torch.Tensor) -> None:
        name = self.tap_name(call, index)
        value = hidden.detach().float().cpu().clone()
        with self._lock:
            self._taps.setdefault(call.request_id, {})[name] = value
            if self.reference is None or call.request_id in self._first:
                return
            expected = self.reference.get(name)
            if expected is None:
                return
            diff = float((value - expected).abs().max()) if expected.shape == value.shape else float("inf")
            if diff > self.tolerance:
                self._first[call.request_id] = Divergence(name, diff, self.tolerance)

    def taps(self, request_id: str) -> dict[str, torch.Tensor]:
        return dict(self._taps.get(request_id, {}))

    def first_divergence(self, request_id: str) -> Divergence | None:
        return self._first.get(request_id)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._taps.pop(request_id, None)
            self._first.pop(request_id, None)
