"""SPMD execution: rank 0 schedules, every rank runs the same WorkUnits in the same order.

Rank 0 runs the whole :class:`~fv_kernel.runtime.engine.Engine` (admission, batching,
loops, cancellation). Every other rank runs :func:`serve_worker`: a loop that receives
rank 0's decisions and executes them. A decision is one call of a collective op (one the
card's implementation says every rank must run: the DiT forward of a sequence-parallel
plan) for one batch: which instance and op, which units (request, loop, step) are in it,
the op's params and input tensors. Rank 0 broadcasts it and then runs the op itself, so
all ranks enter the op's collectives (all-to-alls, CFG gathers) together. Ops without
collectives (text encode, VAE decode) run on rank 0 alone.

Cancellations and aborts need no message of their own: a cancelled request's units are
dropped by rank 0's scheduler before they are picked, so no rank ever runs them; workers
hold no per-request state to clean up. Every rank keeps the ledger of decisions it ran
(``ledger``), which the tests compare across ranks.

A rank that dies (or a collective that fails) fails the op on rank 0. When the launcher
can restart the other ranks (fv's own spawn: ``SpmdLeader.recover``), rank 0 restarts
them on a new process group and runs the call again: the requests' LoopStates are on
rank 0 and have not advanced, so they resume at the failed step. Otherwise (torchrun, or
the restarts used up) the op raises :class:`RankFailure`: the requests of that batch fail
with it, and every later step fails at once with the same error instead of hanging.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from fv_kernel.errors import FvError
from fv_kernel.parallel.mesh import ParallelRuntime
from fv_kernel.parallel.plan import ParallelPlan, ParallelPlanError

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.model.instance import ModelInstance
    from fv_kernel.loop.plan import StepOp
    from fv_kernel.card.spec import ModelCard
    from fv_kernel.request.request import Request

__all__ = [
    "RankFailure",
    "ParallelImplementation",
    "SpmdLeader",
    "Decision",
    "serve_worker",
    "parallel_instance",
]

log = logging.getLogger(__name__)

UnitId = tuple[str, str, int | None]


class RankFailure(FvError):
    """A rank of the parallel pool died or a collective failed: the steps in flight cannot finish."""

    error_type = "rank_failure"


class ParallelImplementation(Protocol):
    """What a card's ``parallelism.implementation`` provides (the family knows its model)."""

    def check_plan(self, card: "ModelCard", plan: ParallelPlan) -> None:
        """Raise :class:`ParallelPlanError` for what only the model knows (e.g. heads vs Ulysses)."""

    def check_request(self, card: "ModelCard", request: "Request", plan: ParallelPlan) -> None:
        """Raise a typed error for a request shape the plan cannot split (e.g. tokens vs sp)."""

    def build_ops(self, instance: "ModelInstance", runtime: ParallelRuntime) -> dict[str, "StepOp"]:
        """The instance's ops, each running its share of the work on this rank's groups."""

    def is_collective(self, op_name: str, plan: ParallelPlan) -> bool:
        """Whether every rank must run ``op_name`` under ``plan`` (it has collectives); the others run on rank 0 alone."""


@dataclass(frozen=True)
class Decision:
    """One op call every rank runs: the units it serves and the op it calls."""

    instance: int
    op: str
    units: tuple[UnitId, ...]


def _is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "broken pipe")
    )


def _picklable_params(op: str, params: Mapping[str, Any]) -> dict[str, Any]:
    if "block_hooks" in params:
        raise ParallelPlanError(
            "sp", f"op {op!r} was asked to run block hooks (block interceptors/observers) under a parallel plan; "
            "they keep per-rank state the SPMD broadcast cannot carry", allowed="no block extensions with a parallel plan",
        )
    return dict(params)


class SpmdLeader:
    """Rank 0's side: wraps each instance's ops so every call is broadcast before it runs."""

    def __init__(self, runtime: ParallelRuntime, instances: list["ModelInstance"]) -> None:
        self.runtime = runtime
        self.instances = instances  # the deployment's list, filled as instances are built
        self.ledger: list[Decision] = []
        self._broken: str | None = None
        self._units = threading.local()
        self._lock = threading.RLock()  # a call retried after a pool restart re-enters it
        #: Restarts the other ranks and returns the new runtime (fv's own launcher can; under
        #: torchrun there is none and a failure is final). See :meth:`call`.
        self.recover: Callable[[], ParallelRuntime] | None = None
        self.max_recoveries = 3
        self.recoveries = 0

    @contextmanager
    def batch(self, units: Sequence[UnitId]) -> Iterator[None]:
        """The units the op calls made inside this block serve (set by the engine per batch)."""
        self._units.current = tuple(units)
        try:
            yield
        finally:
            self._units.current = ()

    def wrap(self, index: int, ops: dict[str, "StepOp"], collective: Any = lambda name: True) -> dict[str, "StepOp"]:
        """Broadcast every call of the ``collective`` ops; the others run on rank 0 alone (the
        workers would only repeat them, and keep rank 0 waiting at the next collective)."""
        from fv_kernel.loop.plan import StepOp

        def wrapped(name: str, op: StepOp) -> StepOp:
            def fn(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
                return self.call(index, name, op, inputs, params)

            return StepOp(name, fn, batch_invariant=op.batch_invariant, supports_block_hooks=False)

        return {name: wrapped(name, op) if collective(name) else op for name, op in ops.items()}

    def call(self, index: int, name: str, op: "StepOp", inputs: Mapping[str, torch.Tensor],
             params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        with self._lock:
            if self._broken is not None:
                raise RankFailure(self._broken)
            decision = Decision(index, name, getattr(self._units, "current", ()))
            header = {
                "kind": "op", "decision": decision, "params": _picklable_params(name, params),
                "components": sorted(self.instances[index].components),
                "tensors": [(key, tuple(t.shape), t.dtype) for key, t in inputs.items()],
            }
            try:
                _broadcast_header(header, self.runtime)
                for key, tensor in inputs.items():
                    dist.broadcast(tensor.detach().to(self.runtime.device).contiguous(), src=0)
                self.ledger.append(decision)
                return op.fn(inputs, params)
            except Exception as exc:
                if not _is_collective_failure(exc):
                    raise
                cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if self.recover is not None and self.recoveries < self.max_recoveries:
                    return self._restart_and_retry(index, name, inputs, params, cause)
                self._broken = (
                    f"parallel pool failed during op {name!r} (world {self.runtime.world_size}, plan "
                    f"{self.runtime.plan.label()}): a rank died or a collective failed ({cause}); the requests "
                    "in flight fail and the pool must be restarted"
                )
                log.error(self._broken)
                raise RankFailure(self._broken) from exc

    def _restart_and_retry(self, index: int, name: str, inputs: Mapping[str, torch.Tensor],
                           params: Mapping[str, Any], cause: str) -> dict[str, torch.Tensor]:
        """Pool-fatal recovery: restart the other ranks, rebuild the ops on the new mesh, run the call again.

        The step's inputs are still in hand and the requests' LoopStates (on rank 0) have not
        advanced, so running the call again on the new pool resumes every request exactly
        where it was: the failed step is the next one.
        """
        assert self.recover is not None
        self.recoveries += 1
        log.warning("parallel pool: %s during op %r; restarting the other ranks (%d of at most %d)",
                    cause, name, self.recoveries, self.max_recoveries)
        try:
            self.runtime = self.recover()
            for instance in self.instances:
                if instance.components:  # ops were built on the old mesh's groups
                    instance._ops = instance.ops_builder(instance)
        except Exception as exc:  # noqa: BLE001 - a pool that cannot restart is broken for good
            self._broken = (f"parallel pool failed during op {name!r} ({cause}) and could not be restarted "
                            f"({type(exc).__name__}: {exc}); restart fv serve")
            log.error(self._broken)
            raise RankFailure(self._broken) from exc
        log.warning("parallel pool restarted (%d ranks); retrying op %r", self.runtime.world_size, name)
        retried = self.instances[index].op(name)
        return retried.fn(inputs, params)

    def shutdown(self) -> None:
        """Release the workers (they return from :func:`serve_worker`)."""
        with self._lock:
            if self._broken is not None:
                return
            try:
                _broadcast_header({"kind": "stop"}, self.runtime)
            except Exception as exc:  # noqa: BLE001 - a dead worker cannot be told to stop
                log.warning("could not tell the workers to stop: %s", exc)
            self._broken = "the parallel pool was shut down"


def _broadcast_header(header: dict[str, Any] | None, runtime: ParallelRuntime) -> dict[str, Any]:
    box = [header]
    dist.broadcast_object_list(box, src=0, device=runtime.device)
    assert box[0] is not None
    return box[0]


@dataclass
class WorkerReport:
    """What a worker ran, for tests and logs."""

    ledger: list[Decision] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def serve_worker(runtime: ParallelRuntime, instances: Sequence["ModelInstance"]) -> WorkerReport:
    """Run rank 0's decisions until it says stop. Returns what ran."""
    report = WorkerReport()
    while True:
        header = _broadcast_header(None, runtime)
        if header["kind"] == "stop":
            return report
        decision: Decision = header["decision"]
        instance = instances[decision.instance]
        for component_id in header["components"]:
            instance.component(component_id)  # same seeded/loaded weights as rank 0, loaded on first use
        inputs = {}
        for key, shape, dtype in header["tensors"]:
            tensor = torch.empty(shape, dtype=dtype, device=runtime.device)
            dist.broadcast(tensor, src=0)
            inputs[key] = tensor
        report.ledger.append(decision)
        try:
            with torch.inference_mode():
                instance.op(decision.op).fn(inputs, header["params"])
        except Exception as exc:
            if _is_collective_failure(exc):
                raise RankFailure(f"worker rank {runtime.rank}: collective failed in op {decision.op!r}: {exc}") from exc
            # The same deterministic error stops rank 0 at the same point (same inputs, same code).
            report.errors.append(f"{decision.op}: {type(exc).__name__}: {exc}")
            log.warning("worker rank %d: op %r raised %s", runtime.rank, decision.op, exc)


def parallel_instance(instance: "ModelInstance", runtime: ParallelRuntime, *, index: int,
                      leader: SpmdLeader | None) -> "ModelInstance":
    """``instance`` with ops from its card's parallel implementation (wrapped for broadcast on rank 0)."""
    import dataclasses

    from fv_kernel.card.refs import import_object

    reference = instance.card.parallelism.implementation
    if reference is None:
        raise ParallelPlanError("sp", f"card {instance.model_id!r} names no parallelism.implementation", allowed="1")
    implementation: ParallelImplementation = import_object(reference)

    def build(inst: "ModelInstance") -> dict[str, "StepOp"]:
        current = leader.runtime if leader is not None else runtime  # a restarted pool has a new mesh
        ops = implementation.build_ops(inst, current)
        if leader is None:
            return ops
        return leader.wrap(index, ops, lambda name: implementation.is_collective(name, current.plan))

    return dataclasses.replace(instance, ops_builder=build)
