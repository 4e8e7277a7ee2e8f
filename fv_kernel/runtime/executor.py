"""The executor: runs a batch of work units on the device thread (design §6.3).

One batch is the units the :class:`~fv_kernel.runtime.batching.BatchScheduler` picked: the
same op of one instance, compatible plans of different requests. The executor runs them as
one fused call where that is allowed (:meth:`Executor.fused_rows`) and per sample otherwise,
times the batch on the device, and checks every output for NaN/Inf. Failures are per unit: an exception or a non-finite output fails that unit's
request only, and a fused batch that raises is re-run per sample to find the culprit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Literal, Mapping, NamedTuple

import torch

from fv_kernel.errors import FvError, InvalidRequest, NonFiniteOutput, StepFailed
from fv_kernel.loop.plan import ShapeSignature, StepOp, StepResult
from fv_kernel.model.instance import ADAPTER_MERGE_COST, ModelInstance
from fv_kernel.runtime.batching import WorkUnit
from fv_kernel.runtime.cost import CostKey, CostModel
from fv_kernel.runtime.metrics import EngineMetrics
from fv_kernel.runtime.scheduler import Lane

__all__ = ["Executor", "BatchOutcome", "check_finite", "check_promised_ops", "MergePolicy", "merge_cost_key"]

log = logging.getLogger("fv.engine")

#: The lanes' CUDA streams' priority: PyTorch's high-priority pool, apart from the default-priority one.
LANE_STREAM_PRIORITY = -1


def hand_to_default_stream(outcomes: "list[StepResult | BaseException]") -> None:
    """Mark every CUDA output of a lane's batch as used on its device's default stream.

    The loops read and drop outputs on the event loop, whose work goes to the default stream; the
    caching allocator then waits for that stream's queued work before handing the block to the lane
    that allocated it (without the mark it would hand it back at once, to a batch running meanwhile).
    """
    for outcome in outcomes:
        if isinstance(outcome, StepResult):
            for tensor in outcome.outputs.values():
                if tensor.device.type == "cuda":
                    tensor.record_stream(torch.cuda.default_stream(tensor.device))


class BatchOutcome(NamedTuple):
    """What running one batch gave."""

    #: One per unit, in order: its result, or the error that fails its request.
    outcomes: list[StepResult | BaseException]
    #: The batch's device seconds when the device can time itself (CUDA events), else None.
    device_seconds: float | None
    #: One per unit: whether its rows ran inside the batch's one fused call.
    fused: tuple[bool, ...]


def merge_cost_key(instance: ModelInstance, elements: int) -> CostKey:
    """The cost-model key of merging (or unmerging) ``elements`` parameter elements of ``instance``."""
    return CostKey(instance.instance_id, "adapter_merge", ShapeSignature.of(params=elements), "any")


class MergePolicy:
    """When a run of forwards that all carry one adapter stack merges it into the weights.

    Merging costs a weight transition now and another later (the exact restore); not merging costs
    every forward its per-row updates. Neither the run's length nor its end is known when it
    starts, so the policy is the classic rent-or-buy rule: the per-row cost the run has paid so far
    (each forward's predicted price times the updates' share of the component's multiply-adds)
    accumulates, and the stack is merged once it reaches the predicted price of the merge and the
    unmerge. Such a run never costs more than twice the best choice made knowing its length. Both
    prices come from the cost model; every transition the instance times calibrates the merge's.
    A forward with mixed stacks ends the run. Exact batches never merge (a merge changes rounding).
    """

    def __init__(self, cost_model: CostModel, metrics: EngineMetrics) -> None:
        self.cost_model = cost_model
        self.metrics = metrics
        #: Per (instance id, component): the stack of the run in progress and its per-row cost so far.
        self._runs: dict[tuple[str, str], tuple[tuple[tuple[str, float], ...], float]] = {}
        #: The lanes' device threads read and update ``_runs`` at once.
        self._runs_lock = threading.Lock()

    def gate(self, instance: ModelInstance, batch: list[WorkUnit], *, allow: bool) -> "_BatchGate":
        return _BatchGate(self, allow, sum(unit.price_seconds for unit in batch))

    def merge_price(self, instance: ModelInstance, elements: int) -> float:
        return self.cost_model.predict(merge_cost_key(instance, elements), ADAPTER_MERGE_COST)


class _BatchGate:
    """One batch's view of the :class:`MergePolicy` (``ModelInstance.merge_gate`` while it runs)."""

    def __init__(self, policy: MergePolicy, allow: bool, price_seconds: float) -> None:
        self.policy = policy
        self.allow_merge = allow
        self.price_seconds = price_seconds

    def should_merge(self, instance: ModelInstance, component: str, stack: tuple[tuple[str, float], ...],
                     flop_fraction: float, elements: int) -> bool:
        key = (instance.instance_id, component)
        price = 2 * self.policy.merge_price(instance, elements)
        with self.policy._runs_lock:
            run_stack, paid = self.policy._runs.get(key, (stack, 0.0))
            paid = (paid if run_stack == stack else 0.0) + self.price_seconds * flop_fraction
            if paid >= price:
                self.policy._runs.pop(key, None)
                return True
            self.policy._runs[key] = (stack, paid)
            return False

    def note_mixed(self, instance: ModelInstance, component: str) -> None:
        with self.policy._runs_lock:
            self.policy._runs.pop((instance.instance_id, component), None)

    def note_transition(self, instance: ModelInstance, component: str, elements: int, seconds: float) -> None:
        self.policy.cost_model.observe(merge_cost_key(instance, elements), ADAPTER_MERGE_COST, seconds)
        self.policy.metrics.note_adapter_transition(seconds)


class Executor:
    """Runs batches on one device thread per lane (or inline on the event loop), alone or fused.

    With a second lane (``SchedulerConfig.overlap_kinds``) two batches may run at once, each on its
    own thread and, on CUDA, its own stream. Each such batch first waits for the work already queued
    on the device's default stream (what the loops' host code, on the event loop, enqueued there),
    and every batch ends with its stream synchronized (the device timing's wait), so what one lane
    hands back is complete before the other lane, or a loop, reads it. Its CUDA outputs are marked
    as used on the default stream (``record_stream``): a loop that queues work on one there and drops
    it while that lane runs its next batch must not see the block reused by that batch before the
    queued work has read it. The lanes' streams come from PyTorch's high-priority pool, which
    ``torch.cuda.Stream()`` (graph captures' side streams) never draws from: a capture on a stream
    that a lane also runs on would record the lane's kernels into the graph.
    """

    def __init__(
        self,
        instances: Mapping[str, ModelInstance],
        metrics: EngineMetrics,
        *,
        batching: Literal["exact", "throughput"],
        check_finite: bool,
        device_thread: bool,
        cost_model: CostModel | None = None,
        lanes: tuple[Lane, ...] = ("main",),
    ) -> None:
        #: The engine's instances by instance id (shared: instances added later are seen).
        self._instances = instances
        self._metrics = metrics
        self.batching = batching
        self.check_finite = check_finite
        self.device_thread = device_thread
        if len(lanes) > 1 and not device_thread:
            raise ValueError("lanes beside 'main' need device_thread=True (a device thread per lane)")
        self.lanes = lanes
        #: One device thread per lane (empty: inline on the event loop).
        self._threads: dict[Lane, concurrent.futures.ThreadPoolExecutor] = {}
        #: Per (lane, device): the CUDA stream that lane's batches run on, when there are several lanes.
        self._streams: dict[tuple[Lane, torch.device], torch.cuda.Stream] = {}
        #: Merged or per-row adapters, per batch (docs/adapters.md).
        self.merges = MergePolicy(cost_model or CostModel(), metrics)

    def start(self) -> None:
        if self.device_thread and not self._threads:
            self._threads = {
                lane: concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="fv-device" if lane == "main" else f"fv-device-{lane}")
                for lane in self.lanes
            }

    def shutdown(self) -> None:
        for pool in self._threads.values():
            pool.shutdown(wait=True)
        self._threads = {}

    async def on_device(self, fn: Callable[..., Any], *args: Any, lane: Lane = "main") -> Any:
        """``fn(*args)`` on ``lane``'s device thread (``SchedulerConfig.device_thread``), else inline on the loop."""
        pool = self._threads.get(lane)
        if pool is None:
            if self._threads:
                raise ValueError(f"no device lane {lane!r}; this executor's lanes: {list(self.lanes)}")
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _lane_stream(self, lane: Lane, batch: list[WorkUnit]) -> "contextlib.AbstractContextManager[Any]":
        """With several lanes, on CUDA: ``lane``'s own stream, made to wait for the default stream's queued work."""
        if len(self.lanes) == 1:
            return contextlib.nullcontext()
        device = self._instances[batch[0].plan.instance_id].device
        if device.type != "cuda":
            return contextlib.nullcontext()
        key = (lane, device)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device, priority=LANE_STREAM_PRIORITY)
        stream.wait_stream(torch.cuda.default_stream(device))
        return torch.cuda.stream(stream)

    def _run_on_lane(self, batch: list[WorkUnit], lane: Lane) -> BatchOutcome:
        with self._lane_stream(lane, batch):
            outcome = self.run_batch(batch)
        if len(self.lanes) > 1:
            hand_to_default_stream(outcome.outcomes)
        return outcome

    async def execute(self, batch: list[WorkUnit], lane: Lane = "main") -> tuple[BatchOutcome, float]:
        """Run ``batch`` on ``lane``'s device thread: its :class:`BatchOutcome`, and the wall seconds it took.

        A batch that cannot even start (its op is missing) fails its own requests, never the
        scheduler: an exception escaping here would end the scheduling task, and every request
        in the engine would then wait forever.
        """
        started = time.perf_counter()
        try:
            outcome: BatchOutcome = await self.on_device(self._run_on_lane, batch, lane, lane=lane)
        except Exception as exc:  # noqa: BLE001
            error = exc if isinstance(exc, FvError) else StepFailed(
                f"step {batch[0].plan.op!r} of loop {batch[0].plan.loop_id!r} could not run: {type(exc).__name__}: {exc}"
            )
            outcome = BatchOutcome([error] * len(batch), None, (False,) * len(batch))
        return outcome, time.perf_counter() - started

    def fused_rows(self, instance: ModelInstance, op: StepOp, batch: list[WorkUnit]) -> list[int]:
        """The positions of ``batch``'s units that run as one fused call of ``op`` (empty: each alone).

        A batch-invariant op fuses in either mode. Otherwise only under ``batching: throughput``,
        only where the card declares how far fusing may move a result at the instance's precision
        (``ParitySpec.batched_vs_alone``) and that promise covers ``op`` (its ``ops`` name it, or
        are empty), and never for an exact unit. Block hooks carry per-request state, so their
        steps always run per sample. A promise naming an op the instance does not have is refused
        (:func:`check_promised_ops`): it would otherwise leave the op it meant unfused, silently.
        """
        if len(batch) < 2 or any("block_hooks" in u.plan.params for u in batch):
            return []
        if op.batch_invariant:
            return list(range(len(batch)))
        if self.batching != "throughput":
            return []
        promise = instance.card.parity.batching_tolerance(instance.precision)
        if promise is None:
            return []
        check_promised_ops(instance)
        if not promise.covers(op.name):
            return []
        rows = [index for index, unit in enumerate(batch) if not unit.exact]
        return rows if len(rows) > 1 else []

    def run_batch(self, batch: list[WorkUnit]) -> BatchOutcome:
        """Runs on the device thread: one outcome per unit, device seconds if known, which rows fused."""
        plan = batch[0].plan
        instance = self._instances[plan.instance_id]
        op = instance.op(plan.op)
        cuda = instance.device.type == "cuda"
        start_evt = end_evt = None
        if cuda:
            start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_evt.record()
        together = self.fused_rows(instance, op, batch)
        outcomes: list[StepResult | BaseException | None] = [None] * len(batch)
        if instance.adapters is not None:
            # Merging changes rounding: an exact unit, or exact batching, keeps every stack per row.
            allow = (instance.adapters.settings.merge == "auto" and self.batching == "throughput"
                     and not any(unit.exact for unit in batch))
            # A forward's price: the fused call's units together, else one unit's.
            fused_units = [batch[i] for i in together] or [max(batch, key=lambda u: u.price_seconds)]
            instance.merge_gate = self.merges.gate(instance, fused_units, allow=allow)
        try:
            done, flags, together = self._run_units(op, plan.params, batch, together, outcomes)
        finally:
            instance.merge_gate = None
        device_s = None
        if cuda and start_evt is not None and end_evt is not None:
            # Before any output is read: an op may hand back host tensors it copied non-blocking.
            end_evt.record()
            end_evt.synchronize()
            device_s = start_evt.elapsed_time(end_evt) / 1000.0
        if flags is not None:
            done = flags.verdicts(batch)
        fused_set = set(together)  # once, not per row
        return BatchOutcome(done, device_s, tuple(index in fused_set for index in range(len(batch))))

    def _run_units(
        self, op: StepOp, params: Mapping[str, Any], batch: list[WorkUnit], together: list[int],
        outcomes: "list[StepResult | BaseException | None]",
    ) -> "tuple[list[StepResult | BaseException], _FiniteFlags | None, list[int]]":
        """The units through ``op``, the ``together`` rows fused (re-run alone if the fused call
        raises): outcomes, their queued NaN/Inf flags, and the rows that did run fused."""
        plan = batch[0].plan
        with torch.inference_mode():
            if together:
                try:
                    fused = op.run_fused([batch[i].plan.inputs for i in together], plan.params)
                    for index, outputs in zip(together, fused):
                        outcomes[index] = StepResult(outputs=outputs)
                except Exception:  # noqa: BLE001 - fall back to per-sample to find the culprit
                    # Visible, not silent: a fused path that always fails would cost every batch twice.
                    log.warning("fused %r step of %d requests failed; re-running them one by one", op.name,
                                len(together), exc_info=True)
                    self._metrics.note_fused_fallback(op.name)
                    together, outcomes = [], [None] * len(batch)
            alone = [index for index, outcome in enumerate(outcomes) if outcome is None]
            for index, outcome in zip(alone, run_per_sample(op, [batch[i] for i in alone])):
                outcomes[index] = outcome
            done: list[StepResult | BaseException] = [o for o in outcomes if o is not None]
            # The device outputs' NaN/Inf flags are queued behind the step, so the one wait below
            # covers them (read after it, they cost each batch a second wait).
            flags = _FiniteFlags(done) if self.check_finite else None
        return done, flags, together


def check_promised_ops(instance: ModelInstance, *, every_op_built: bool | None = None) -> None:
    """Refuse the card's ``parity.batched_vs_alone`` promise at ``instance``'s precision if its ``ops``
    name an op the instance does not have: :class:`~fv_kernel.errors.InvalidRequest` naming
    ``parity.batched_vs_alone.ops`` and the instance's ops.

    A card does not list its ops (its factory builds them from the components loaded so far), so the
    card spec cannot check the names. ``every_op_built`` None: decided once every component of the
    card's checkpoint is loaded (before, a name may belong to a component still to load); True: the
    caller knows every op it will use is built (the conformance gate, after running every task).
    """
    promise = instance.card.parity.batching_tolerance(instance.precision)
    if promise is None or not promise.ops:
        return
    if every_op_built is None:
        every_op_built = all(c in instance.components for c in instance.card.checkpoint.components)
    if not every_op_built:
        return
    built = instance.ops
    unknown = [name for name in promise.ops if name not in built]
    if unknown:
        raise InvalidRequest(
            "parity.batched_vs_alone.ops",
            f"card {instance.model_id!r} promises fused steps at {instance.precision} for ops {unknown} that its "
            "instance does not have",
            allowed=sorted(built) or "none (no op built yet)",
        )


def run_per_sample(op: StepOp, batch: list[WorkUnit]) -> list[StepResult | BaseException]:
    """Each unit through ``op`` alone; an exception becomes that unit's outcome (a typed error)."""
    outcomes: list[StepResult | BaseException] = []
    for unit in batch:
        try:
            outcomes.append(StepResult(outputs=op.fn(unit.plan.inputs, unit.plan.params)))
        except FvError as exc:
            outcomes.append(exc)
        except Exception as exc:  # noqa: BLE001
            outcomes.append(StepFailed(f"step {op.name!r} raised {type(exc).__name__}: {exc}"))
    return outcomes


def check_finite(outcomes: list[StepResult | BaseException], batch: list[WorkUnit]) -> list[StepResult | BaseException]:
    """Each unit's outcome, or NonFiniteOutput naming its first floating output with NaN/Inf."""
    return _FiniteFlags(outcomes).verdicts(batch)


def _in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous view when its elements are dense in another dim order
    (channels-last, a transpose), else ``tensor`` itself."""
    if tensor.is_contiguous():
        return tensor
    permuted = tensor.permute(sorted(range(tensor.dim()), key=tensor.stride, reverse=True))
    return permuted if permuted.is_contiguous() else tensor


def _all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``tensor``'s device: no NaN or Inf in it. Its min and max decide (both
    propagate NaN): one read, where ``isfinite(t).all()`` also wrote a tensor-sized bool mask (on
    the host for a decode step's pinned frames, on the device for its GBs of causal cache).
    The whole-tensor min/max packs a non-contiguous tensor into a contiguous copy first, so a
    dense one (the channels-last cache) is reduced through a contiguous view of its memory:
    the copies cost 10 ms per 448x832 decode step on the H200."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(torch.stack(torch.aminmax(_in_memory_order(tensor)))).all()


class _FiniteFlags:
    """A batch's NaN/Inf check in two halves: flags queued on each device, then read once per device.

    A step can return dozens of tensors (a causal VAE decode returns its cache), and checking each
    alone waited on the device each time. Host outputs are checked only when read: an op may still
    be copying into them non-blocking until the batch's wait.
    """

    def __init__(self, outcomes: list[StepResult | BaseException]) -> None:
        self.outcomes = outcomes
        self.checked = [(index, name, tensor) for index, outcome in enumerate(outcomes)
                        if not isinstance(outcome, BaseException)
                        for name, tensor in outcome.outputs.items() if tensor.is_floating_point()]
        by_device: dict[torch.device, list[int]] = {}
        for position, (_, _, tensor) in enumerate(self.checked):
            by_device.setdefault(tensor.device, []).append(position)
        self.queued = [(positions, torch.stack([_all_finite(self.checked[p][2]) for p in positions]))
                       for device, positions in by_device.items() if device.type != "cpu"]
        self.host = by_device.get(torch.device("cpu"), [])

    def verdicts(self, batch: list[WorkUnit]) -> list[StepResult | BaseException]:
        """Each unit's outcome, or NonFiniteOutput naming its first floating output with NaN/Inf."""
        finite = [True] * len(self.checked)
        groups = list(self.queued)
        if self.host:
            groups.append((self.host, torch.stack([_all_finite(self.checked[p][2]) for p in self.host])))
        for positions, flags in groups:
            for position, ok in zip(positions, flags.tolist()):
                finite[position] = bool(ok)
        result = list(self.outcomes)
        for position, (index, name, _) in enumerate(self.checked):
            if finite[position] or isinstance(result[index], BaseException):
                continue  # finite, or an earlier output of this unit already failed it
            plan = batch[index].plan
            result[index] = NonFiniteOutput(
                f"step {plan.op!r} of loop {plan.loop_id!r} produced NaN/Inf in output {name!r} "
                f"at step {plan.step_index if plan.step_index is not None else '?'}"
            )
        return result
