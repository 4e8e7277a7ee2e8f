"""The scheduler: the engine's queues, admission passes and batch choice (design §6).

- **RequestScheduler** (:class:`RequestQueue`): submitted requests waiting for admission,
  bounded (``QueueFull``), interactive before batch-class, first in first out within a class.
- **LoopScheduler** (:class:`PendingUnits`): every ``await ctx.execute(plan)`` of every
  running driver, as a :class:`~fv_kernel.runtime.batching.WorkUnit`, until the
  :class:`~fv_kernel.runtime.batching.BatchScheduler` picks it.

:class:`Scheduler` makes the decisions over them; :class:`SchedulerConfig` is the
``scheduler:`` section of the deploy config.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Callable, Iterable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fv_kernel.cache.feature import apply_cache_writes
from fv_kernel.errors import QueueFull
from fv_kernel.loop.plan import CancelScope, StepResult, WorkKind, WorkPlan
from fv_kernel.model.instance import ModelInstance
from fv_kernel.program.base import Program
from fv_kernel.request.request import Request
from fv_kernel.runtime.admission import AdmissionController, Budgets, Reservation
from fv_kernel.runtime.batching import BatchPolicy, BatchScheduler, WorkUnit
from fv_kernel.runtime.capacity import ResidentMemory
from fv_kernel.runtime.cost import CostKey, CostModel
from fv_kernel.runtime.metrics import EngineMetrics
from fv_kernel.runtime.pricing import reservation_for
from fv_kernel.runtime.records import RequestRecord

__all__ = ["SchedulerConfig", "RequestQueue", "PendingUnits", "Scheduler", "Lane", "LANES", "OVERLAP_KINDS"]

#: The device lanes batches run on: "main" always; "overlap" for ``SchedulerConfig.overlap_kinds``.
Lane = Literal["main", "overlap"]
LANES: tuple[Lane, ...] = ("main", "overlap")
#: The kinds ``SchedulerConfig.overlap_kinds`` may name: decode-side steps, whose ops share no
#: mutable state with a card's other steps. Others do: an AR card's prefill and token steps share
#: one KV pool and captured graphs, its ``encoder_chunk`` text step may run the same tower, and two
#: threads using one graph pool or workspace corrupt each other's memory.
OVERLAP_KINDS: tuple[WorkKind, ...] = (WorkKind.VAE_TILE, WorkKind.AUDIO_CHUNK)


class SchedulerConfig(BaseModel):
    """The runtime's knobs; the ``scheduler:`` section of the deploy config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: "step": interleave the steps of all running requests. "request": run one request
    #: to completion before the next starts (the baseline step-level scheduling must beat).
    scheduling: Literal["step", "request"] = "step"
    #: "throughput" (the default): compatible steps of different requests run as one fused call
    #: when the op is batch-invariant, or when the card declares how far that may move a result
    #: at the instance's precision (``ParitySpec.batched_vs_alone``); a request with ``exact`` or
    #: ``output.capture_behavior`` set still runs its rows alone. "exact": every op that is not
    #: batch-invariant runs per sample, so each result is bit-identical to the request run alone.
    batching: Literal["exact", "throughput"] = "throughput"
    batch: BatchPolicy = BatchPolicy()
    budgets: Budgets = Budgets()
    max_running_requests: int = Field(default=64, ge=1)
    max_queue: int = Field(default=256, ge=1)
    #: Abort a request whose step output holds NaN/Inf (only that request).
    check_finite: bool = True
    #: Run model code on a dedicated thread (keeps the event loop responsive).
    device_thread: bool = True
    #: Finished requests whose records (events, artifacts) the engine keeps for late
    #: subscribers; older ones are forgotten so a long-running server does not grow.
    keep_finished: int = Field(default=1024, ge=0)
    #: At most this many bytes of tensors (input images, frames, previews, latents) held by
    #: the finished records kept; the oldest are forgotten first. A caller that holds a
    #: request's handle keeps its result either way; ``Engine.forget`` drops one at once.
    keep_finished_bytes: int = Field(default=256 * 2**20, ge=0)
    #: Step kinds that run on a second device lane (its own device thread and, on CUDA, its own
    #: stream) while the main lane runs the other kinds: ``[vae_tile]`` lets one request's VAE
    #: decode run beside the next request's denoise steps. Two batches then run at once, so a batch
    #: starts beside the other lane's only if both peaks fit the memory budget's headroom.
    #: Empty (the default): one lane, one batch at a time.
    overlap_kinds: tuple[WorkKind, ...] = ()

    @model_validator(mode="after")
    def _overlap_needs_device_thread(self) -> "SchedulerConfig":
        if self.overlap_kinds and not self.device_thread:
            raise ValueError("scheduler.overlap_kinds needs scheduler.device_thread: true (each lane runs on a "
                             "device thread of its own)")
        if len(set(self.overlap_kinds)) != len(self.overlap_kinds):
            raise ValueError(f"scheduler.overlap_kinds names a kind twice: {[k.value for k in self.overlap_kinds]}")
        refused = [k.value for k in self.overlap_kinds if k not in OVERLAP_KINDS]
        if refused:
            raise ValueError(f"scheduler.overlap_kinds: {refused} cannot run on a lane of their own (their ops may "
                             "share KV pools, captured graphs or workspaces with the card's other steps); allowed: "
                             f"{[k.value for k in OVERLAP_KINDS]}")
        return self


class RequestQueue:
    """RequestScheduler's queue: bounded, FIFO within a priority class, interactive before batch-class,
    except that a batch-class request queued longer than ``batch_class_max_wait_s`` goes first: a
    steady stream of interactive requests cannot starve it (the batch scheduler's rule for steps)."""

    def __init__(self, max_queue: int, batch_class_max_wait_s: float = BatchPolicy().batch_class_max_wait_s) -> None:
        self.max_queue = max_queue
        self.batch_class_max_wait_s = batch_class_max_wait_s
        self._items: deque[RequestRecord] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, record: RequestRecord) -> None:
        if len(self._items) >= self.max_queue:
            raise QueueFull(self.max_queue)
        self._items.append(record)

    def remove(self, record: RequestRecord) -> bool:
        try:
            self._items.remove(record)
        except ValueError:
            return False
        return True

    def ordered(self, now: float | None = None) -> list[RequestRecord]:
        """The queue in admission order (``now``: ``time.monotonic()`` by default)."""
        now = time.monotonic() if now is None else now

        def rank(record: RequestRecord) -> int:
            if record.request.priority == "interactive":
                return 1
            return 0 if now - record.queued_at > self.batch_class_max_wait_s else 2

        return sorted(self._items, key=rank)


class PendingUnits:
    """LoopScheduler's collection of plans awaiting execution."""

    def __init__(self) -> None:
        self.units: list[WorkUnit] = []
        self._seq = 0

    def add(self, unit: WorkUnit) -> None:
        self._seq += 1
        unit.seq = self._seq
        self.units.append(unit)

    def take(self, batch: Iterable[WorkUnit]) -> None:
        chosen = {id(u) for u in batch}
        self.units = [u for u in self.units if id(u) not in chosen]

    def drop_request(self, request_id: str, *, abandonable_only: bool = False) -> list[WorkUnit]:
        """Remove the request's units; ``abandonable_only`` keeps those planned with ``CancelScope.NONE``."""

        def dropped_unit(u: WorkUnit) -> bool:
            return u.request_id == request_id and not (abandonable_only and u.plan.cancel_scope is CancelScope.NONE)

        dropped = [u for u in self.units if dropped_unit(u)]
        self.units = [u for u in self.units if not dropped_unit(u)]
        return dropped


class Scheduler:
    """The request, loop and batch schedulers over one admission controller: what runs next.

    Pure decisions and bookkeeping, on the engine's event loop: which queued requests to
    admit (:meth:`admit`), what each planned step costs (:meth:`work_unit`), which compatible
    units run together next (:meth:`next_batch`) and how a batch's outcomes go back to the
    drivers awaiting them (:meth:`hand_back`). The engine runs the drivers and the executor.
    """

    def __init__(self, config: SchedulerConfig, cost_model: CostModel, metrics: EngineMetrics) -> None:
        self.config = config
        self.cost_model = cost_model
        self.metrics = metrics
        self.admission = AdmissionController(config.budgets)
        self.memory = ResidentMemory(config.budgets, self.admission)
        #: One batch scheduler per lane: a jumbo step waits on the work of its own lane only.
        self.batchers: dict[Lane, BatchScheduler] = {lane: BatchScheduler(config.batch) for lane in self.lanes}
        self.queue = RequestQueue(config.max_queue, config.batch.batch_class_max_wait_s)
        self.pending = PendingUnits()
        self.running: dict[str, RequestRecord] = {}
        #: Model ids whose admission is frozen by a weight sync in progress (``Engine.sync_weights``).
        self.frozen: set[str] = set()

    @property
    def lanes(self) -> tuple[Lane, ...]:
        """The lanes batches run on: ("main",), or ("main", "overlap") with ``overlap_kinds`` set."""
        return LANES if self.config.overlap_kinds else LANES[:1]

    def lane_of(self, plan: WorkPlan) -> Lane:
        """The lane ``plan`` runs on."""
        return "overlap" if plan.kind in self.config.overlap_kinds else "main"

    def count_rejection(self, reason: str) -> None:
        self.metrics.rejections[reason] = self.metrics.rejections.get(reason, 0) + 1

    def reservation_for(self, instance: ModelInstance, request: Request) -> Reservation:
        """What admitting ``request`` (resolved against ``instance``) reserves now, on its device."""
        return reservation_for(instance, request, self.cost_model, device=self.memory.device_of[instance.instance_id])

    def admit(
        self, instances: Iterable[ModelInstance], reject: Callable[[RequestRecord, BaseException], None]
    ) -> list[tuple[RequestRecord, Program]]:
        """One admission pass over the queue: the requests admitted now, each with its program.

        A request whose reservation does not fit waits, and nothing behind it in its class
        overtakes it (strict FIFO); one that can never run (or whose estimate is broken) leaves
        the queue through ``reject``. ``scheduling: request`` admits one request at a time.
        """
        limit = 1 if self.config.scheduling == "request" else self.config.max_running_requests
        if len(self.queue):
            self.memory.size(instances)
        admitted: list[tuple[RequestRecord, Program]] = []
        for record in self.queue.ordered():
            if len(self.running) >= limit:
                break
            if record.request.model in self.frozen:
                continue  # its instance is changing weights; other instances keep admitting
            request = record.request
            try:
                program = record.instance.program(request.task)
                if record.reservation is None:
                    record.reservation = self.reservation_for(record.instance, request)
                blocked = self.admission.try_admit(record.reservation)
            except Exception as exc:  # a request that can never run, or a broken estimate
                self.queue.remove(record)
                reject(record, exc)
                continue
            if blocked is not None:
                self.count_rejection(f"admission_{blocked}")
                break  # strict FIFO within the class: a later request must not overtake a blocked one
            self.queue.remove(record)
            self.running[request.request_id] = record
            record.status = "in_progress"
            admitted.append((record, program))
        return admitted

    def work_unit(
        self, record: RequestRecord, instance: ModelInstance, plan: WorkPlan, future: "asyncio.Future[StepResult]"
    ) -> WorkUnit:
        """``plan`` (of a loop of ``instance``) as a unit of the loop scheduler: priced (its own
        price, else the cost model's conservative one) and kept batch-of-1 when the card's loop
        forbids batching."""
        loop_spec = instance.card.loops.get(plan.loop_id)  # None: a kernel step (an adapter load)
        if plan.batchable and loop_spec is not None and not loop_spec.batchable:
            # The card's LoopSpec can forbid cross-request batching for every step of a loop.
            plan = plan.model_copy(update={"batchable": False})
        price = plan.resources.gpu_seconds
        if price is None:
            key = CostKey(plan.instance_id, plan.kind.value, plan.shape_sig, plan.precision)
            price = self.cost_model.conservative(key, instance.step_cost(plan.loop_id))
        request = record.request
        unit = WorkUnit(
            plan=plan, request_id=request.request_id, future=future, enqueued_at=time.monotonic(),
            price_seconds=price, priority=request.priority,
            # RL capture records what one request's own forward did (C2): it never shares a fused call.
            exact=request.exact or request.output.capture_behavior != "off",
        )
        self.pending.add(unit)
        return unit

    def next_batch(self, lane: Lane = "main", *, beside_peak_bytes: int | None = None) -> list[WorkUnit]:
        """The next group of compatible pending units of ``lane`` to run (taken from the pending set), or none.

        ``beside_peak_bytes``: the peak of a batch running on the other lane now. The two run at
        once, so this batch's peak must fit beside it, its first unit's included: admission
        reserved one peak per request, not two batches' at the same time.
        """
        # Admitted requests' peaks may add up only within what their residents leave free.
        headroom = self.admission.peak_headroom()
        units = self.pending.units
        if len(self.lanes) > 1:
            units = [u for u in units if self.lane_of(u.plan) == lane]
        if beside_peak_bytes is not None and headroom is not None:
            headroom = max(headroom - beside_peak_bytes, 0)
        batch = self.batchers[lane].select(units, time.monotonic(), peak_headroom=headroom,
                                           head_must_fit=beside_peak_bytes is not None)
        if batch:
            self.pending.take(batch)
        return batch

    def hand_back(
        self, batch: list[WorkUnit], outcomes: list[StepResult | BaseException], device_s: float | None, wall: float,
        services: Mapping[str, Any], *, fused_rows: int = 0, lane: Lane = "main",
    ) -> tuple[str, ...]:
        """Settle an executed batch: charge each request its share, resolve each driver's future
        (applying the plan's cache writes first), count it (``fused_rows``: the units that ran in
        its one fused call). Returns the requests whose step failed."""
        self.metrics.execute_seconds += wall
        self.batchers[lane].note_executed(batch, device_s if device_s is not None else wall)
        plan = batch[0].plan
        self.metrics.units_by_kind[plan.kind.value] = self.metrics.units_by_kind.get(plan.kind.value, 0) + len(batch)
        self.metrics.batches_by_size[len(batch)] = self.metrics.batches_by_size.get(len(batch), 0) + 1
        if fused_rows > 1:
            self.metrics.fused_calls_by_size[fused_rows] = self.metrics.fused_calls_by_size.get(fused_rows, 0) + 1
        self.metrics.observe_latency(wall)
        share = (device_s if device_s is not None else wall) / len(batch)
        failed: list[str] = []
        for unit, outcome in zip(batch, outcomes):
            self.admission.charge(unit.request_id, share)
            if unit.future.done():
                continue
            if isinstance(outcome, BaseException):
                failed.append(unit.request_id)
                unit.future.set_exception(outcome)
            else:
                outcome.wall_seconds = wall
                outcome.batch_size = len(batch)
                if unit.plan.cache.writes:
                    apply_cache_writes(unit.plan.cache, outcome.outputs, services)
                unit.future.set_result(outcome)
        return tuple(failed)
