"""The Engine: resident instances, many concurrent requests, one scheduler (design §6).

Layers, each testable on its own:

- **RequestScheduler** (:class:`RequestQueue`): accepts requests, bounds the queue,
  admits them through the :class:`~fv_kernel.runtime.admission.AdmissionController`
  and starts their programs' loop drivers.
- **LoopScheduler** (:class:`PendingUnits`): every ``await ctx.execute(plan)`` of every
  driver lands here as a :class:`~fv_kernel.runtime.batching.WorkUnit`.
- **BatchScheduler**: picks the next group of compatible units across requests.
- **Executor**: runs the group on the device thread, alone or batched, isolating
  failures per request.

The engine runs on the caller's asyncio loop; model code runs on one device thread
so the loop stays responsive (HTTP, SSE) while a step computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import typing
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from fv_kernel.cache.feature import FeatureCache, apply_cache_writes
from fv_kernel.card.instance import ModelInstance
from fv_kernel.card.validate import RequestLimits, resolve_for_instance
from fv_kernel.errors import (
    FvError,
    NonFiniteOutput,
    QueueFull,
    RequestCancelled,
    StepFailed,
    UnknownModel,
)
from fv_kernel.extend.hooks import RequestHooks
from fv_kernel.extend.observers import BlockObserver, Observer, Profiler, StepRecord
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.loop.context import CancelToken, LoopContext
from fv_kernel.loop.contract import CancelScope, StepResult, WorkPlan
from fv_kernel.loop.driver import LoopCancelled
from fv_kernel.loop.samplers import use_samplers
from fv_kernel.program.resume import ProgramCheckpoint, ProgramRun, run_program
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.events import TERMINAL_EVENT_TYPES, ErrorInfo, Event
from fv_kernel.request.request import Request
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.admission import AdmissionController, Budgets, Reservation
from fv_kernel.runtime.batching import BatchPolicy, BatchScheduler, WorkUnit
from fv_kernel.runtime.blocking import run_blocking
from fv_kernel.runtime.capacity import device_key, device_total_bytes, instance_resident_bytes
from fv_kernel.runtime.cost import CostKey, CostModel

__all__ = [
    "SchedulerConfig",
    "Engine",
    "RequestHandle",
    "GenerationResult",
    "RequestQueue",
    "PendingUnits",
    "EngineMetrics",
]

log = logging.getLogger("fv.engine")
_EVENT_CLASSES: dict[str, type] = {
    cls.model_fields["type"].default: cls for cls in typing.get_args(typing.get_args(Event)[0])
}


class SchedulerConfig(BaseModel):
    """The runtime's knobs; the ``scheduler:`` section of the deploy config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: "step": interleave the steps of all running requests. "request": run one request
    #: to completion before the next starts (the baseline step-level scheduling must beat).
    scheduling: Literal["step", "request"] = "step"
    #: "exact": a batch of ops that are not batch-invariant runs per sample (bit-identical to
    #: serial). "throughput": always fuse compatible steps into one batched call.
    batching: Literal["exact", "throughput"] = "exact"
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


@dataclass
class GenerationResult:
    request_id: str
    status: Literal["completed", "failed", "cancelled"]
    artifacts: list[Artifact] = field(default_factory=list)
    error: ErrorInfo | None = None

    def artifact(self, kind: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.kind == kind), None)

    def raise_for_status(self) -> "GenerationResult":
        if self.status != "completed":
            detail = self.error.message if self.error else self.status
            raise StepFailed(f"request {self.request_id} {self.status}: {detail}")
        return self


class _Record:
    """Everything the engine tracks for one request."""

    def __init__(self, request: Request, instance: ModelInstance, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.instance = instance
        self.cancel = CancelToken()
        self.events: list[Event] = []
        self.subscribers: list[asyncio.Queue[Event]] = []
        self.done: asyncio.Future[GenerationResult] = loop.create_future()
        self.task: asyncio.Task[None] | None = None
        self.status: str = "queued"
        self.steps_done = 0
        #: The request's way through its program, when it resumes a checkpoint or reports steps.
        self.program_run: ProgramRun | None = None
        #: Priced once, when the request first reaches the head of its queue.
        self.reservation: Reservation | None = None

    def emit(self, event_type: str, **fields: Any) -> None:
        event_cls = _EVENT_CLASSES.get(event_type)
        if event_cls is None:
            raise ValueError(f"unknown event type {event_type!r}; allowed: {sorted(_EVENT_CLASSES)}")
        event = event_cls(request_id=self.request.request_id, seq=len(self.events), **fields)
        self.events.append(event)
        for queue in self.subscribers:
            queue.put_nowait(event)

    @property
    def finished(self) -> bool:
        return self.done.done()


def held_tensor_bytes(*objects: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``objects`` (models, lists, dicts)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = list(objects)
    visited: set[int] = set()
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, BaseModel):
            if id(obj) not in visited:
                visited.add(id(obj))
                stack.extend(obj.__dict__.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
    return total


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


class RequestHandle:
    """The caller's view of a submitted request."""

    def __init__(self, engine: "Engine", record: _Record) -> None:
        self._engine = engine
        self._record = record

    @property
    def request_id(self) -> str:
        return self._record.request.request_id

    @property
    def status(self) -> str:
        return self._record.status

    @property
    def progress(self) -> float:
        for event in reversed(self._record.events):
            if event.type == "progress" and event.total:
                return min(event.step / event.total, 1.0)
        return 1.0 if self._record.status == "completed" else 0.0

    async def events(self) -> AsyncIterator[Event]:
        """Every event of the request in order, from the first, until the terminal one."""
        record = self._record
        queue: asyncio.Queue[Event] = asyncio.Queue()
        history = list(record.events)
        record.subscribers.append(queue)
        try:
            for event in history:
                yield event
                if event.type in TERMINAL_EVENT_TYPES:
                    return
            if history and history[-1].type in TERMINAL_EVENT_TYPES:
                return
            while True:
                event = await queue.get()
                if event.seq < len(history):
                    continue
                yield event
                if event.type in TERMINAL_EVENT_TYPES:
                    return
        finally:
            record.subscribers.remove(queue)

    async def result(self) -> GenerationResult:
        return await asyncio.shield(self._record.done)

    def cancel(self, reason: str = "cancelled by caller") -> None:
        self._engine.cancel(self.request_id, reason)


class RequestQueue:
    """RequestScheduler's queue: bounded, FIFO within a priority class."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._items: deque[_Record] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, record: _Record) -> None:
        if len(self._items) >= self.max_queue:
            raise QueueFull(self.max_queue)
        self._items.append(record)

    def remove(self, record: _Record) -> bool:
        try:
            self._items.remove(record)
        except ValueError:
            return False
        return True

    def ordered(self) -> list[_Record]:
        return sorted(self._items, key=lambda r: 0 if r.request.priority == "interactive" else 1)


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


@dataclass
class EngineMetrics:
    """Counters the serving layer exports (Prometheus)."""

    units_by_kind: dict[str, int] = field(default_factory=dict)
    batches_by_size: dict[int, int] = field(default_factory=dict)
    step_latency_buckets: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, math.inf)
    step_latency_counts: list[int] = field(default_factory=lambda: [0] * 10)
    step_latency_sum: float = 0.0
    step_latency_count: int = 0
    #: The scheduler's own host time: admission, choosing each batch, and handing its results back.
    scheduler_seconds: float = 0.0
    #: Time the scheduler yields before choosing a batch so that the drivers the last batch woke post
    #: their next plans: the loops' own host code (advance, next, finalize), not the scheduler's.
    loop_host_seconds: float = 0.0
    execute_seconds: float = 0.0
    rejections: dict[str, int] = field(default_factory=dict)
    #: Fused (throughput-mode) batches that raised and were re-run per request, by op.
    fused_fallbacks: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    failed: int = 0
    cancelled: int = 0

    def observe_latency(self, seconds: float) -> None:
        for i, bound in enumerate(self.step_latency_buckets):
            if seconds <= bound:
                self.step_latency_counts[i] += 1
        self.step_latency_sum += seconds
        self.step_latency_count += 1


class Engine:
    """Serves many concurrent requests over resident model instances."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        limits: RequestLimits | None = None,
        cost_model: CostModel | None = None,
        observers: Iterable[Observer] = (),
        profile: bool = True,
        hooks: Any = None,
        extensions: ExtensionSet | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.limits = limits or RequestLimits()
        self.cost_model = cost_model or CostModel()
        self.profiler = Profiler(self.cost_model) if profile else None
        #: Deploy-enabled interceptors and observers (validated when the deploy config was).
        self.extensions = extensions or ExtensionSet()
        self.observers: list[Observer] = (
            ([self.profiler] if self.profiler else []) + list(observers)
            + [o for o in self.extensions.observers if not isinstance(o, BlockObserver)]
        )
        self.admission = AdmissionController(self.config.budgets)
        #: Total memory of each device an instance lives on (sized once, for "auto" budgets).
        self._device_total: dict[str, int] = {}
        #: Per instance id: how many components were loaded when it was measured, and the bytes
        #: they (and its pools) keep. Components are only ever added, so the count marks a change.
        self._resident_cache: dict[str, tuple[int, int]] = {}
        #: (components loaded, resident bytes) measured by a load's own thread, right after it loaded.
        self._resident_measured: dict[str, tuple[int, int]] = {}
        #: Per instance id: its device's key (``device_key``), computed once in :meth:`add_instance`.
        self._device_of: dict[str, str] = {}
        self.batcher = BatchScheduler(self.config.batch)
        self.metrics = EngineMetrics()
        #: The plugin host's typed hook façade, for lifecycle broadcasts (None: no plugins).
        self.hooks = hooks
        #: Engine-wide services loops reach through ``ctx.services`` (shared caches).
        self.services: dict[str, Any] = {"feature_cache": FeatureCache()}
        self._instances: dict[str, ModelInstance] = {}
        self._by_instance_id: dict[str, ModelInstance] = {}
        self._records: dict[str, _Record] = {}
        self._queue = RequestQueue(self.config.max_queue)
        self._pending = PendingUnits()
        self._running: dict[str, _Record] = {}
        #: Component loads in flight, one per (instance, task): co-arriving requests share it.
        self._loads: dict[tuple[str, TaskType], asyncio.Future[None]] = {}
        #: Finished requests still recorded, oldest first, with the tensor bytes each holds.
        self._finished: dict[str, int] = {}
        self._finished_bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._scheduler_task: asyncio.Task[None] | None = None
        self._device: concurrent.futures.ThreadPoolExecutor | None = None
        self._stopping = False
        #: Model ids whose admission is frozen by a weight sync in progress (:meth:`sync_weights`).
        self._frozen: set[str] = set()
        #: Weight syncs done per model id (names the next weights_version).
        self._syncs: dict[str, int] = {}

    # -- instances ----------------------------------------------------------------
    def add_instance(self, instance: ModelInstance) -> None:
        if instance.model_id in self._instances:
            raise ValueError(f"an instance of {instance.model_id!r} is already resident")
        self.extensions.check_cards([instance.card])
        device = device_key(instance.device)
        if self.config.budgets.memory_bytes == "auto" and device not in self._device_total:
            self._device_total[device] = device_total_bytes(device)  # fails here, typed, for an unsizable device
        for name, pool in instance.block_pools().items():
            self.admission.register_pool(self._pool_key(instance, name), pool.capacity_blocks)
        self._instances[instance.model_id] = instance
        self._by_instance_id[instance.instance_id] = instance
        self._device_of[instance.instance_id] = device
        # Deploy-time work that would otherwise land in the scheduler on the first admission:
        # importing the card's loop classes (lazy "module:Class" entries) and sizing what the
        # instance keeps resident (re-sized later only if it loads more components).
        for loop_id in instance.card.loops:
            try:
                instance.loop_class(loop_id)
            except Exception:  # noqa: BLE001 - left to fail its requests, typed, as before; the host keeps serving
                log.warning("loop %r of card %r could not be resolved; its requests will fail", loop_id,
                            instance.model_id, exc_info=True)
        self._size_memory()

    @property
    def instances(self) -> dict[str, ModelInstance]:
        return dict(self._instances)

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        if self._scheduler_task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stopping = False
        if self.config.device_thread:
            self._device = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fv-device")
        self._scheduler_task = asyncio.create_task(self._schedule_forever(), name="fv-scheduler")
        if self.hooks is not None:
            self.hooks.engine_started(self)

    async def stop(self) -> None:
        """Cancel what is still running, wait for it to wind down, stop the scheduler."""
        if self._scheduler_task is None:
            return
        if self.hooks is not None:
            self.hooks.engine_stopping(self)
        for record in list(self._records.values()):
            if not record.finished:
                self.cancel(record.request.request_id, "engine stopping")
        tasks = [r.task for r in self._records.values() if r.task is not None and not r.task.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._stopping = True
        assert self._wake is not None
        self._wake.set()
        await self._scheduler_task
        self._scheduler_task = None
        if self._device is not None:
            self._device.shutdown(wait=True)
            self._device = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator["Engine"]:
        await self.start()
        try:
            yield self
        finally:
            await self.stop()

    # -- requests -----------------------------------------------------------------
    def validate(self, request: Request) -> Request:
        """Resolve ``request`` against its card: defaults filled, or a typed error. No compute."""
        instance = self._instances.get(request.model)
        if instance is None:
            raise UnknownModel(request.model, self._instances)
        resolved = resolve_for_instance(instance, request, self.limits)
        self.hooks_for(instance, resolved)
        return resolved

    def hooks_for(self, instance: ModelInstance, request: Request) -> RequestHooks | None:
        """The request's active extensions, validated (raises InvalidRequest for bad plugin_params)."""
        loop_ids = instance.program(request.task).loop_ids(request)
        return self.extensions.hooks_for(instance.card, loop_ids, request.plugin_params, exact=request.exact)

    def submit(
        self,
        request: Request,
        *,
        resume_from: ProgramCheckpoint | None = None,
        on_step: Callable[[ProgramRun], None] | None = None,
    ) -> RequestHandle:
        """Validate and enqueue; returns at once. Must be called on the engine's event loop.

        ``resume_from`` continues a :class:`ProgramCheckpoint` of this request (checked
        here: an unusable one raises ``CheckpointIncompatible`` / ``ProgramNotResumable``).
        ``on_step(run)`` is called after every step of the request; ``run.checkpoint()``
        is its resume point at that moment.
        """
        if self._scheduler_task is None or self._loop is None:
            raise RuntimeError("the engine is not running: use 'async with engine.running():' or await engine.start()")
        try:
            resolved = self.validate(request)
        except FvError as exc:
            self._count_rejection(exc.error_type)
            raise
        if resolved.request_id in self._records:
            raise ValueError(f"request id {resolved.request_id!r} was already submitted")
        instance = self._instances[resolved.model]
        record = _Record(resolved, instance, self._loop)
        if resume_from is not None or on_step is not None:
            try:
                record.program_run = ProgramRun(
                    instance.program(resolved.task), instance, resolved, resume_from=resume_from, on_step=on_step,
                )
            except FvError as exc:
                self._count_rejection(exc.error_type)
                raise
        try:
            self._queue.push(record)
        except QueueFull:
            self._count_rejection("queue_full")
            raise
        self._records[resolved.request_id] = record
        record.emit("request.queued")
        self._kick()
        return RequestHandle(self, record)

    def handle(self, request_id: str) -> RequestHandle:
        return RequestHandle(self, self._records[request_id])

    async def generate_async(self, request: Request) -> GenerationResult:
        return await self.submit(request).result()

    def generate(self, request: Request) -> GenerationResult:
        """Blocking convenience: start the engine on a private loop, run one request, stop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("Engine.generate() blocks; inside an event loop use 'await engine.generate_async(...)'")

        async def once() -> GenerationResult:
            async with self.running():
                return await self.generate_async(request)

        return run_blocking(once())

    def cancel(self, request_id: str, reason: str = "cancelled by caller") -> bool:
        """Cancel at the next step boundary. Returns False if the request already ended."""
        record = self._records.get(request_id)
        if record is None or record.finished:
            return False
        record.cancel.cancel(reason)
        if self._queue.remove(record):
            record.status = "cancelled"
            record.emit("request.cancelled", reason=reason)
            record.done.set_result(GenerationResult(request_id, "cancelled"))
            self.metrics.cancelled += 1
            self._retire(request_id)
            return True
        # Steps planned with CancelScope.NONE stay queued and run; the driver stops after them.
        for unit in self._pending.drop_request(request_id, abandonable_only=True):
            if not unit.future.done():
                unit.future.set_exception(RequestCancelled(reason))
        self._kick()
        return True

    # -- weight sync -------------------------------------------------------------------
    async def sync_weights(
        self, model_id: str, load: Callable[[ModelInstance], None], *, version: str | None = None
    ) -> str:
        """Swap the weights of ``model_id``'s instance while serving; returns the new ``weights_version``.

        The lifecycle (design §10): freeze admission for the instance (its queued requests
        wait; other instances keep serving) -> drain the requests running on it, which finish
        on the old weights -> ``load(instance)`` on the device thread (in place, e.g.
        ``load_state_dict``) -> bump ``weights_version`` -> clear the engine's caches (entries
        keyed by the old version can never hit again) -> resume admission. A request never
        mixes two policies. Must be awaited on the engine's event loop.
        """
        if self._scheduler_task is None or self._loop is None:
            raise RuntimeError("the engine is not running: use 'async with engine.running():' or await engine.start()")
        instance = self._instances.get(model_id)
        if instance is None:
            raise UnknownModel(model_id, self._instances)
        if model_id in self._frozen:
            raise RuntimeError(f"a weight sync of {model_id!r} is already in progress")
        self._frozen.add(model_id)
        try:
            await self._drain(instance)
            await self._on_device(load, instance)  # never concurrently with a batch
            count = self._syncs.get(model_id, 0) + 1
            self._syncs[model_id] = count
            instance.weights_version = version or f"{instance.weights_version.split('+sync')[0]}+sync{count}"
            for service in self.services.values():
                clear = getattr(service, "clear", None)
                if callable(clear):
                    clear()
            return instance.weights_version
        finally:
            self._frozen.discard(model_id)
            self._kick()

    async def _on_device(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the device thread (``SchedulerConfig.device_thread``), else inline on the loop."""
        if self._device is None:
            return fn(*args)
        assert self._loop is not None
        return await self._loop.run_in_executor(self._device, fn, *args)

    async def _drain(self, instance: ModelInstance) -> None:
        """Wait until no admitted request runs on ``instance`` (admission to it is frozen)."""
        while True:
            tasks = [r.task for r in self._running.values() if r.instance is instance and r.task is not None]
            if not tasks:
                return
            await asyncio.wait(tasks)

    def queue_depth(self) -> int:
        return len(self._queue)

    def running_count(self) -> int:
        return len(self._running)

    # -- internals: request scheduler ------------------------------------------------
    def _count_rejection(self, reason: str) -> None:
        self.metrics.rejections[reason] = self.metrics.rejections.get(reason, 0) + 1

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- admission --------------------------------------------------------------------
    @staticmethod
    def _pool_key(instance: ModelInstance, name: str) -> str:
        return f"{instance.instance_id}/{name}"

    def reservation_for(self, request: Request) -> Reservation:
        """What admitting ``request`` (as :meth:`validate` resolves it) reserves now.

        The program's estimate, with its steps priced by the calibrated cost model
        (``CostModel.price``: the Profiler's correction times the spec's conservative
        factor), its pool blocks keyed by this engine's pools, on the instance's device.
        """
        instance = self._instances.get(request.model)
        if instance is None:
            raise UnknownModel(request.model, self._instances)
        # An estimate may build the request's sampler (a loop prices its steps by its timesteps): names
        # resolve through the instance's deploy registry, plugins' samplers included, as in the driver.
        with use_samplers(instance.registry.samplers):
            need = instance.program(request.task).estimate(instance, request)
        seconds = need.gpu_seconds or 0.0
        for step in need.steps:
            spec = instance.card.loops.get(step.loop_id)
            if spec is None:
                raise ValueError(f"an estimate of {instance.model_id!r} prices steps of unknown loop {step.loop_id!r}")
            seconds += self.cost_model.price(instance.instance_id, step, spec.step_cost)
        pools = instance.block_pools()
        pool_blocks: dict[str, int] = {}
        for name, blocks in need.pool_blocks.items():
            if name not in pools:
                raise ValueError(f"an estimate of {instance.model_id!r} reserves blocks of pool {name!r}; "
                                 f"the instance has {sorted(pools) or 'no pools'}")
            pool_blocks[self._pool_key(instance, name)] = blocks
        return Reservation(
            request.request_id, need.resident_bytes, need.peak_bytes, need.cache_blocks, seconds,
            pool_blocks=pool_blocks, device=self._device_of[instance.instance_id],
        )

    def _size_memory(self) -> None:
        """Size each device's ``"auto"`` memory budget: total x (1 - headroom) - what resident instances keep.

        Runs in :meth:`add_instance` and on every scheduler pass with a queue, so it re-sizes only
        when an instance is new or has loaded components since it was last measured (weights load
        lazily); an Engine-driven load was measured by its own thread (:meth:`_load_and_measure`).
        """
        budgets = self.config.budgets
        if budgets.memory_bytes != "auto":
            return
        changed = False
        for instance in self._instances.values():
            loaded = len(instance.components)
            cached = self._resident_cache.get(instance.instance_id)
            if cached is None or cached[0] != loaded:
                measured = self._resident_measured.pop(instance.instance_id, None)
                if measured is None or measured[0] != loaded:
                    measured = (loaded, instance_resident_bytes(instance))
                self._resident_cache[instance.instance_id] = measured
                changed = True
        if not changed:
            return
        resident: dict[str, int] = {}
        for instance_id, (_, kept_bytes) in self._resident_cache.items():
            device = self._device_of[instance_id]
            resident[device] = resident.get(device, 0) + kept_bytes
        for device, total in self._device_total.items():
            usable = int(total * (1.0 - budgets.memory_headroom))
            kept = resident.get(device, 0)
            self.admission.set_memory_capacity(
                device, max(usable - kept, 0),
                f"auto: {total} bytes of {device} x (1 - memory_headroom {budgets.memory_headroom}) - {kept} bytes "
                "kept by resident instances",
            )

    def _admit_queued(self) -> None:
        limit = 1 if self.config.scheduling == "request" else self.config.max_running_requests
        if len(self._queue):
            self._size_memory()
        for record in self._queue.ordered():
            if len(self._running) >= limit:
                return
            if record.request.model in self._frozen:
                continue  # its instance is changing weights (sync_weights); other instances keep admitting
            request = record.request
            try:
                program = record.instance.program(request.task)
                if record.reservation is None:
                    record.reservation = self.reservation_for(request)
                blocked = self.admission.try_admit(record.reservation)
            except Exception as exc:  # a request that can never run, or a broken estimate
                self._queue.remove(record)
                self._finish_failed(record, exc)
                self._retire(request.request_id)
                continue
            if blocked is not None:
                self._count_rejection(f"admission_{blocked}")
                # Strict FIFO within the class: a later request must not overtake a blocked one.
                return
            self._queue.remove(record)
            self._running[request.request_id] = record
            record.status = "in_progress"
            record.task = asyncio.create_task(self._run_request(record, program), name=f"fv-req-{request.request_id}")

    async def _run_request(self, record: _Record, program: Any) -> None:
        request = record.request
        record.emit("request.started")
        ctx = LoopContext(
            request=request,
            executor=lambda plan: self._enqueue(record, plan),
            emit_event=record.emit,
            cancel=record.cancel,
            services=self.services,
            hooks=self.hooks_for(record.instance, request),
        )
        try:
            await self._load_for(record.instance, request.task)
            artifacts = await run_program(program, record.instance, ctx, run=record.program_run)
        except (LoopCancelled, RequestCancelled) as exc:
            partial = exc.partial.artifacts if isinstance(exc, LoopCancelled) and exc.partial else []
            partial = request.output.keep(partial)
            for artifact in partial:
                record.emit("artifact.ready", artifact=artifact)
            record.status = "cancelled"
            record.emit("request.cancelled", reason=str(exc.message if isinstance(exc, FvError) else exc))
            self.metrics.cancelled += 1
            record.done.set_result(GenerationResult(request.request_id, "cancelled", list(partial)))
        except Exception as exc:  # noqa: BLE001 - isolate: one request's failure ends only it
            self._finish_failed(record, exc)
        else:
            artifacts = request.output.keep(artifacts)  # only the artifact kinds the request asked for
            for artifact in artifacts:
                record.emit("artifact.ready", artifact=artifact)
            record.status = "completed"
            record.emit("request.completed")
            self.metrics.completed += 1
            record.done.set_result(GenerationResult(request.request_id, "completed", artifacts))
        finally:
            if self.hooks is not None:
                try:
                    self.hooks.request_finished(request.request_id, record.status)
                except Exception:  # noqa: BLE001 - a plugin's listener must not fail the request
                    log.exception("fv_request_finished hook failed")
            self._running.pop(request.request_id, None)
            self._retire(request.request_id)
            for unit in self._pending.drop_request(request.request_id):
                if not unit.future.done():
                    unit.future.cancel()
            self.admission.release(request.request_id)
            self._kick()

    async def _load_for(self, instance: ModelInstance, task: TaskType) -> None:
        """Load what ``task`` needs off the event loop (weights can take seconds), once.

        Every request that arrives while the load runs awaits the same load and so resumes in the
        same event-loop pass: co-arriving requests post their first steps together and batch.
        """
        if instance.loaded_for(task):
            instance.load_for_task(task)  # validates the task; loads nothing
            return
        key = (instance.instance_id, task)
        load = self._loads.get(key)
        if load is None:
            load = asyncio.ensure_future(asyncio.to_thread(self._load_and_measure, instance, task))
            self._loads[key] = load
            load.add_done_callback(lambda _: self._loads.pop(key, None))
        await asyncio.shield(load)  # a cancelled request must not cancel the others' load

    def _load_and_measure(self, instance: ModelInstance, task: TaskType) -> None:
        """Load on a worker thread, then measure what the instance now keeps resident there too, so
        the next admission re-sizes the memory budget without walking the weights in the scheduler."""
        instance.load_for_task(task)
        if self.config.budgets.memory_bytes == "auto":  # only an "auto" budget subtracts what is resident
            self._resident_measured[instance.instance_id] = (len(instance.components), instance_resident_bytes(instance))

    def _retire(self, request_id: str) -> None:
        """Note a finished request; forget the oldest finished ones beyond ``keep_finished`` records
        or ``keep_finished_bytes`` of tensors."""
        record = self._records.get(request_id)
        if record is None or request_id in self._finished:
            return
        held = held_tensor_bytes(record.request, record.events)
        self._finished[request_id] = held
        self._finished_bytes += held
        config = self.config
        while self._finished and (
            len(self._finished) > config.keep_finished or self._finished_bytes > config.keep_finished_bytes
        ):
            self.forget(next(iter(self._finished)))

    def forget(self, request_id: str) -> bool:
        """Drop a finished request's record now: its events, artifacts and input tensors (a caller
        holding its handle keeps the result). Returns False if it is unknown or still running."""
        record = self._records.get(request_id)
        if record is None or not record.finished:
            return False
        del self._records[request_id]
        self._finished_bytes -= self._finished.pop(request_id, 0)
        return True

    def retained(self) -> tuple[int, int]:
        """Finished requests the engine still records, and the tensor bytes they hold."""
        return len(self._finished), self._finished_bytes

    def _finish_failed(self, record: _Record, exc: BaseException) -> None:
        if isinstance(exc, FvError):
            info = ErrorInfo(**exc.info())
        else:
            log.exception("request %s failed", record.request.request_id, exc_info=exc)
            info = ErrorInfo(type="internal_error", message=f"{type(exc).__name__}: {exc}")
        record.status = "failed"
        record.emit("request.failed", error=info)
        self.metrics.failed += 1
        if not record.done.done():
            record.done.set_result(GenerationResult(record.request.request_id, "failed", error=info))

    # -- internals: loop scheduler --------------------------------------------------
    async def _enqueue(self, record: _Record, plan: WorkPlan) -> StepResult:
        if plan.cancel_scope is not CancelScope.NONE:  # a NONE step, once planned, runs even after a cancel
            record.cancel.raise_if_cancelled()
        assert self._loop is not None
        instance = self._by_instance_id.get(plan.instance_id)
        if instance is None:
            raise StepFailed(f"plan names unknown instance {plan.instance_id!r}")
        loop_spec = instance.card.loops[plan.loop_id]
        if plan.batchable and not loop_spec.batchable:
            # The card's LoopSpec can forbid cross-request batching for every step of a loop.
            plan = plan.model_copy(update={"batchable": False})
        spec = loop_spec.step_cost
        key = CostKey(plan.instance_id, plan.kind.value, plan.shape_sig, plan.precision)
        price = plan.resources.gpu_seconds
        if price is None:
            price = self.cost_model.conservative(key, spec)
        unit = WorkUnit(
            plan=plan, request_id=record.request.request_id, future=self._loop.create_future(),
            enqueued_at=time.monotonic(), price_seconds=price, priority=record.request.priority,
        )
        self._pending.add(unit)
        self._kick()
        return await unit.future

    async def _settle(self) -> None:
        # Drivers woken by the last batch compute their next plan synchronously; two
        # passes of the event loop let every one of them post it before we pick a batch.
        for _ in range(2):
            await asyncio.sleep(0)

    async def _schedule_forever(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            tick = time.perf_counter()
            self._admit_queued()
            yielded = time.perf_counter()
            await self._settle()
            resumed = time.perf_counter()
            self._admit_queued()
            # Admitted requests' peaks may add up only within what their residents leave free.
            headroom = self.admission.peak_headroom()
            batch = self.batcher.select(self._pending.units, time.monotonic(), peak_headroom=headroom)
            self.metrics.loop_host_seconds += resumed - yielded
            self.metrics.scheduler_seconds += (yielded - tick) + (time.perf_counter() - resumed)
            if not batch:
                if self._stopping and not self._running:
                    return
                await self._wake.wait()
                continue
            self._pending.take(batch)
            await self._execute(batch)

    # -- internals: executor --------------------------------------------------------
    async def _execute(self, batch: list[WorkUnit]) -> None:
        assert self._loop is not None
        live = [u for u in batch if not u.future.done()]
        if not live:
            return
        started = time.perf_counter()
        try:
            outcomes, device_s = await self._on_device(self._run_batch, live)
        except Exception as exc:  # noqa: BLE001 - the batch could not start (e.g. its op is missing)
            # It fails its own requests, never the scheduler: an escaped exception here ended the
            # scheduling task, and every request in the engine then waited forever.
            error = exc if isinstance(exc, FvError) else StepFailed(
                f"step {live[0].plan.op!r} of loop {live[0].plan.loop_id!r} could not run: {type(exc).__name__}: {exc}"
            )
            outcomes, device_s = [error] * len(live), None
        wall = time.perf_counter() - started
        self.metrics.execute_seconds += wall
        handed_back = time.perf_counter()
        self.batcher.note_executed(live, device_s if device_s is not None else wall)
        plan = live[0].plan
        self.metrics.units_by_kind[plan.kind.value] = self.metrics.units_by_kind.get(plan.kind.value, 0) + len(live)
        self.metrics.batches_by_size[len(live)] = self.metrics.batches_by_size.get(len(live), 0) + 1
        self.metrics.observe_latency(wall)
        share = (device_s if device_s is not None else wall) / len(live)
        failed = []
        for unit, outcome in zip(live, outcomes):
            self.admission.charge(unit.request_id, share)
            if unit.future.done():
                continue
            if isinstance(outcome, BaseException):
                failed.append(unit.request_id)
                unit.future.set_exception(outcome)
            else:
                outcome.wall_seconds = wall
                outcome.batch_size = len(live)
                if unit.plan.cache.writes:
                    apply_cache_writes(unit.plan.cache, outcome.outputs, self.services)
                unit.future.set_result(outcome)
        if self.observers:
            instance = self._by_instance_id[plan.instance_id]
            record = StepRecord(
                instance_id=plan.instance_id, loop_id=plan.loop_id, kind=plan.kind.value, op=plan.op,
                shape_sig=plan.shape_sig, precision=plan.precision,
                request_ids=tuple(u.request_id for u in live), steps=tuple(u.plan.step_index or 0 for u in live),
                wall_seconds=wall, device_seconds=device_s, predicted_seconds=sum(u.price_seconds for u in live),
                cost_spec=instance.card.loops[plan.loop_id].step_cost, failed=tuple(failed),
            )
            for observer in self.observers:
                try:
                    observer.on_step(record)
                except Exception:  # noqa: BLE001 - an observer must never take a request down
                    log.exception("observer %s failed", getattr(observer, "name", observer))
        self.metrics.scheduler_seconds += time.perf_counter() - handed_back

    def _run_batch(self, batch: list[WorkUnit]) -> tuple[list[StepResult | BaseException], float | None]:
        """Runs on the device thread. Returns one outcome per unit, and device seconds if known."""
        plan = batch[0].plan
        instance = self._by_instance_id[plan.instance_id]
        op = instance.op(plan.op)
        inputs = [u.plan.inputs for u in batch]
        cuda = instance.device.type == "cuda"
        start_evt = end_evt = None
        if cuda:
            start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_evt.record()
        # Block hooks carry per-request state, so their steps always run per sample.
        hooked = any("block_hooks" in u.plan.params for u in batch)
        fuse = len(batch) > 1 and not hooked and (self.config.batching == "throughput" or op.batch_invariant)
        outcomes: list[StepResult | BaseException]
        with torch.inference_mode():
            if fuse:
                try:
                    outcomes = [StepResult(outputs=o) for o in op.run_fused(inputs, plan.params)]
                except Exception:  # noqa: BLE001 - fall back to per-sample to find the culprit
                    # Visible, not silent: a fused path that always fails would cost every batch twice.
                    log.warning("fused %r step of %d requests failed; re-running them one by one", op.name, len(batch),
                                exc_info=True)
                    self.metrics.fused_fallbacks[op.name] = self.metrics.fused_fallbacks.get(op.name, 0) + 1
                    outcomes = self._per_sample(op, batch)
            else:
                outcomes = self._per_sample(op, batch)
            # The device outputs' NaN/Inf flags are queued behind the step, so the one wait below
            # covers them (read after it, they cost each batch a second wait).
            flags = _FiniteFlags(outcomes) if self.config.check_finite else None
        device_s = None
        if cuda and start_evt is not None and end_evt is not None:
            # Before any output is read: an op may hand back host tensors it copied non-blocking.
            end_evt.record()
            end_evt.synchronize()
            device_s = start_evt.elapsed_time(end_evt) / 1000.0
        if flags is not None:
            outcomes = flags.verdicts(batch)
        return outcomes, device_s

    @staticmethod
    def _per_sample(op: Any, batch: list[WorkUnit]) -> list[StepResult | BaseException]:
        outcomes: list[StepResult | BaseException] = []
        for unit in batch:
            try:
                outcomes.append(StepResult(outputs=op.fn(unit.plan.inputs, unit.plan.params)))
            except FvError as exc:
                outcomes.append(exc)
            except Exception as exc:  # noqa: BLE001
                outcomes.append(StepFailed(f"step {op.name!r} raised {type(exc).__name__}: {exc}"))
        return outcomes

    @staticmethod
    def _check_finite(
        outcomes: list[StepResult | BaseException], batch: list[WorkUnit]
    ) -> list[StepResult | BaseException]:
        """Each unit's outcome, or NonFiniteOutput naming its first floating output with NaN/Inf."""
        return _FiniteFlags(outcomes).verdicts(batch)


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


def run_serially(engine: Engine, requests: Iterable[Request]) -> list[GenerationResult]:
    """Run requests one after another on ``engine`` (the reference side of the interleave gate)."""

    async def go() -> list[GenerationResult]:
        results = []
        async with engine.running():
            for request in requests:
                results.append(await engine.generate_async(request))
        return results

    return run_blocking(go())


def run_concurrently(engine: Engine, requests: Iterable[Request]) -> list[GenerationResult]:
    """Submit all requests at once and wait for all (the interleaved side of the gate)."""

    async def go() -> list[GenerationResult]:
        async with engine.running():
            handles = [engine.submit(r) for r in requests]
            return list(await asyncio.gather(*(h.result() for h in handles)))

    return run_blocking(go())
