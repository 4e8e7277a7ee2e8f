"""The Engine: resident instances, many concurrent requests, one scheduler (design §6).

The engine core wires four parts, each its own module and testable alone:

- **RequestScheduler** (:class:`~fv_kernel.runtime.scheduler.RequestQueue`): accepts
  requests, bounds the queue, admits them through the
  :class:`~fv_kernel.runtime.admission.AdmissionController` (reservations priced by
  :mod:`fv_kernel.runtime.pricing`, memory sized by
  :class:`~fv_kernel.runtime.capacity.ResidentMemory`) and starts their programs' loop drivers.
- **LoopScheduler** (:class:`~fv_kernel.runtime.scheduler.PendingUnits`): every
  ``await ctx.execute(plan)`` of every driver lands here as a
  :class:`~fv_kernel.runtime.batching.WorkUnit`.
- **BatchScheduler** (:mod:`fv_kernel.runtime.batching`): picks the next group of
  compatible units across requests.
- **Executor** (:mod:`fv_kernel.runtime.executor`): runs the group on the device thread,
  alone or batched, isolating failures per request.

The engine runs on the caller's asyncio loop; model code runs on one device thread
so the loop stays responsive (HTTP, SSE) while a step computes. With
``SchedulerConfig.overlap_kinds`` set, a second device lane runs those kinds' batches
(a request's VAE decode) while the main lane runs the rest (another request's denoise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable, Iterable

from torch import nn

from fv_kernel.cache.block_pool import BlockPool
from fv_kernel.cache.slab_kv import SlabKVPool
from fv_kernel.cache.adapters import AdapterRegistry
from fv_kernel.cache.feature import FeatureCache
from fv_kernel.errors import FvError, InvalidRequest, QueueFull, RequestCancelled, StepFailed, UnknownModel
from fv_kernel.extend.hooks import RequestHooks
from fv_kernel.extend.observers import BlockObserver, Observer, StepRecord
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.loop.contract import LoopContext
from fv_kernel.loop.driver import LoopCancelled
from fv_kernel.loop.plan import CancelScope, ShapeSignature, StepResult, WorkKind, WorkPlan
from fv_kernel.model.instance import ADAPTER_LOAD_OP, ADAPTER_LOOP, ModelInstance
from fv_kernel.model.validate import RequestLimits, resolve_for_instance
from fv_kernel.program.base import Program
from fv_kernel.program.resume import ProgramCheckpoint, ProgramRun, run_program
from fv_kernel.request.events import ErrorInfo
from fv_kernel.request.request import Request
from fv_kernel.runtime.admission import AdmissionController, Reservation
from fv_kernel.runtime.batching import WorkUnit
from fv_kernel.runtime.blocking import run_blocking
from fv_kernel.runtime.capacity import ComponentLoads
from fv_kernel.runtime.cost import CostModel, Profiler
from fv_kernel.runtime.executor import Executor
from fv_kernel.runtime.metrics import EngineMetrics
from fv_kernel.runtime.pricing import pool_key
from fv_kernel.runtime.records import GenerationResult, RecordStore, RequestHandle, RequestRecord
from fv_kernel.runtime.scheduler import Lane, Scheduler, SchedulerConfig
from fv_kernel.runtime.sessions import SessionHandle, SessionManager, SessionRecord
from fv_kernel.request.session import SessionRequest

__all__ = ["Engine", "run_serially", "run_concurrently"]

log = logging.getLogger("fv.engine")


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
        adapters: AdapterRegistry | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        #: The deployment's adapter registry (docs/adapters.md); None: adapters are off. Every
        #: instance added shares it.
        self.adapters = adapters
        self.limits = limits or RequestLimits()
        self.cost_model = cost_model or CostModel()
        self.profiler = Profiler(self.cost_model) if profile else None
        #: Deploy-enabled interceptors and observers (validated when the deploy config was).
        self.extensions = extensions or ExtensionSet()
        self.observers: list[Observer] = (
            ([self.profiler] if self.profiler else []) + list(observers)
            + [o for o in self.extensions.observers if not isinstance(o, BlockObserver)]
        )
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(self.config, self.cost_model, self.metrics)
        #: The plugin host's typed hook façade, for lifecycle broadcasts (None: no plugins).
        self.hooks = hooks
        #: Engine-wide services loops reach through ``ctx.services`` (shared caches).
        self.services: dict[str, Any] = {"feature_cache": FeatureCache()}
        self._instances: dict[str, ModelInstance] = {}
        self._by_instance_id: dict[str, ModelInstance] = {}
        self.executor = self.make_executor()
        self._store = RecordStore(keep=self.config.keep_finished, keep_bytes=self.config.keep_finished_bytes)
        self._records: dict[str, RequestRecord] = self._store.records
        self._loads = ComponentLoads(self.scheduler.memory)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._scheduler_task: asyncio.Task[None] | None = None
        #: With several lanes: the batch running on each busy lane (its task and summed peak bytes).
        self._lane_runs: dict[Lane, tuple[asyncio.Task[None], int]] = {}
        self._stopping = False
        #: Weight syncs done per model id (names the next weights_version).
        self._syncs: dict[str, int] = {}
        #: Adapter loads in flight, per (instance id, version): co-arriving requests share one.
        self._adapter_loads: dict[tuple[str, str], asyncio.Future[None]] = {}
        #: Realtime sessions (docs/realtime.md): admitted and scheduled like requests.
        self.sessions = SessionManager(self)

    def _check_attention_beside_lanes(self, instance: ModelInstance) -> None:
        """Refuse an attention driver that sets process-wide torch flags while a second lane runs.

        ``sdpa_kernel`` (the pinned ``sdpa_*`` drivers) disables SDPA's other kernels for the whole
        process during a call; the other lane's attention (a VAE's, of head dim 384 on Wan) would
        find only the pinned kernel enabled meanwhile and fail, or run another kernel than alone.
        """
        drivers = instance.registry.attention_backends
        name = instance.options.attention_backend
        try:
            driver = drivers.load(name)
        except Exception:  # noqa: BLE001 - a driver that cannot load failed the instance's build already
            return
        if not getattr(driver, "sets_process_flags", False):
            return
        safe = []
        for other in drivers.names():
            try:
                if not getattr(drivers.load(other), "sets_process_flags", False):
                    safe.append(other)
            except Exception:  # noqa: BLE001 - an unloadable driver is not offered
                continue
        kinds = [kind.value for kind in self.config.overlap_kinds]
        raise InvalidRequest(
            "attention_backend",
            f"{instance.model_id!r} is deployed with attention driver {name!r}, which pins SDPA's kernel through "
            f"torch's process-wide sdpa_kernel flags; the second device lane (scheduler.overlap_kinds: {kinds}) "
            "would run its own attention under them",
            allowed=f"a driver that sets no process-wide flags ({', '.join(sorted(safe))}), or scheduler.overlap_kinds: []",
        )

    def make_executor(self) -> Executor:
        """The executor batches run on (a subclass may announce each batch, as a parallel pool's rank 0 does)."""
        return Executor(
            self._by_instance_id, self.metrics, batching=self.config.batching, check_finite=self.config.check_finite,
            device_thread=self.config.device_thread, cost_model=self.cost_model, lanes=self.scheduler.lanes,
        )

    # -- instances ----------------------------------------------------------------
    def add_instance(self, instance: ModelInstance) -> None:
        if instance.model_id in self._instances:
            raise ValueError(f"an instance of {instance.model_id!r} is already resident")
        self.extensions.check_cards([instance.card])
        if len(self.scheduler.lanes) > 1:
            self._check_attention_beside_lanes(instance)
        device = self.scheduler.memory.add_instance(instance)  # fails here, typed, for an unsizable device
        if self.adapters is not None:
            instance.adapters = self.adapters
        if instance.adapters is not None:
            self.admission.set_adapter_capacity(device, instance.adapters.settings.device_budget_bytes)
        for name, pool in instance.block_pools().items():
            if not isinstance(pool, BlockPool):
                raise TypeError(f"{instance.model_id!r}'s block pool {name!r} is a {type(pool).__name__}, not a BlockPool "
                                "(capacity_blocks, used_blocks, free_blocks, capacity_bytes)")
            # Paged text-KV pools count blocks, slab chunk-KV pools slabs: admission reserves either by name.
            self.admission.register_pool(pool_key(instance, name), pool.capacity_blocks)
        self._instances[instance.model_id] = instance
        self._by_instance_id[instance.instance_id] = instance
        promise = instance.card.parity.batching_tolerance(instance.precision)
        if self.config.batching == "throughput" and promise is None:
            log.info("card %r declares no parity.batched_vs_alone at %s: its steps run unfused (as under batching: "
                     "exact) unless an op is batch-invariant", instance.model_id, instance.precision)
        elif self.config.batching == "throughput" and promise is not None and promise.ops:
            log.info("card %r's parity.batched_vs_alone at %s covers ops %s (text %s): its other ops run unfused "
                     "unless batch-invariant", instance.model_id, instance.precision, list(promise.ops), promise.text)
        # Deploy-time work that would otherwise land in the scheduler on the first admission:
        # importing the card's loop classes (lazy "module:Class" entries) and sizing what the
        # instance keeps resident (re-sized later only if it loads more components).
        for loop_id in instance.card.loops:
            try:
                instance.loop_class(loop_id)
            except Exception:  # noqa: BLE001 - left to fail its requests, typed, as before; the host keeps serving
                log.warning("loop %r of card %r could not be resolved; its requests will fail", loop_id,
                            instance.model_id, exc_info=True)
        self.scheduler.memory.size(self._instances.values())

    @property
    def instances(self) -> dict[str, ModelInstance]:
        return dict(self._instances)

    @property
    def admission(self) -> AdmissionController:
        """The admission controller (the scheduler's): budgets, pools, reservations held."""
        return self.scheduler.admission

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        if self._scheduler_task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stopping = False
        self.executor.start()
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
        self.executor.shutdown()

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
            self.scheduler.count_rejection(exc.error_type)
            raise
        if resolved.request_id in self._records:
            raise ValueError(f"request id {resolved.request_id!r} was already submitted")
        instance = self._instances[resolved.model]
        record = RequestRecord(resolved, instance, self._loop)
        if resume_from is not None or on_step is not None:
            try:
                record.program_run = ProgramRun(
                    instance.program(resolved.task), instance, resolved, resume_from=resume_from, on_step=on_step,
                )
            except FvError as exc:
                self.scheduler.count_rejection(exc.error_type)
                raise
        try:
            self.scheduler.queue.push(record)
        except QueueFull:
            self.scheduler.count_rejection("queue_full")
            raise
        self._records[resolved.request_id] = record
        record.emit("request.queued")
        self._kick()
        return RequestHandle(record, self.cancel)

    def open_session(self, session: SessionRequest) -> SessionHandle:
        """Open a realtime session on a card with a ``chunk_rollout`` loop (docs/realtime.md).

        Admitted like a request (its reservation, chunk-KV slabs included, must fit: until it
        does the session waits; one that can never fit raises ``CapacityError``); every step
        is a WorkUnit of this engine's scheduler. Must be called on the engine's event loop.
        """
        return self.sessions.open(session)

    def resume_session(self, data: bytes) -> SessionHandle:
        """Continue a session from ``await handle.suspend()``'s bytes (this process or another)."""
        return self.sessions.resume(data)

    def handle(self, request_id: str) -> RequestHandle:
        return RequestHandle(self._records[request_id], self.cancel)

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
        if self.scheduler.queue.remove(record):
            record.status = "cancelled"
            record.emit("request.cancelled", reason=reason)
            record.done.set_result(GenerationResult(request_id, "cancelled"))
            self.metrics.cancelled += 1
            self._retire(request_id)
            return True
        # Steps planned with CancelScope.NONE stay queued and run; the driver stops after them.
        for unit in self.scheduler.pending.drop_request(request_id, abandonable_only=True):
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
        if model_id in self.scheduler.frozen:
            raise RuntimeError(f"a weight sync of {model_id!r} is already in progress")
        self.scheduler.frozen.add(model_id)
        try:
            await self._drain(instance)
            # A merged adapter stack's restore would otherwise write the old weights back over the new.
            await self.executor.on_device(instance.unmerge_all)
            # On the main lane's thread, never beside a batch of this instance (drained); with scheduler.overlap_kinds
            # another instance's batch may run on the overlap lane meanwhile.
            await self.executor.on_device(load, instance)
            count = self._syncs.get(model_id, 0) + 1
            self._syncs[model_id] = count
            instance.weights_version = version or f"{instance.weights_version.split('+sync')[0]}+sync{count}"
            for service in self.services.values():
                clear = getattr(service, "clear", None)
                if callable(clear):
                    clear()
            return instance.weights_version
        finally:
            self.scheduler.frozen.discard(model_id)
            self._kick()

    async def _drain(self, instance: ModelInstance) -> None:
        """Wait until no admitted request runs on ``instance`` (admission to it is frozen)."""
        while True:
            tasks = [r.task for r in self.scheduler.running.values() if r.instance is instance and r.task is not None]
            if not tasks:
                return
            await asyncio.wait(tasks)

    def queue_depth(self) -> int:
        return len(self.scheduler.queue)

    def running_count(self) -> int:
        return len(self.scheduler.running)

    # -- internals: request scheduler ------------------------------------------------
    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- admission --------------------------------------------------------------------
    def reservation_for(self, request: Request) -> Reservation:
        """What admitting ``request`` (as :meth:`validate` resolves it) reserves now
        (:func:`~fv_kernel.runtime.pricing.reservation_for` on its instance's device)."""
        instance = self._instances.get(request.model)
        if instance is None:
            raise UnknownModel(request.model, self._instances)
        return self.scheduler.reservation_for(instance, request)

    def _admit_queued(self) -> None:
        for record, program in self.scheduler.admit(self._instances.values(), self._reject):
            name = f"fv-req-{record.request.request_id}"
            run = self.sessions.run if isinstance(record, SessionRecord) else self._run_request
            record.task = asyncio.create_task(run(record, program), name=name)

    def _reject(self, record: RequestRecord, exc: BaseException) -> None:
        """A queued request that can never run (or whose estimate is broken) fails at admission."""
        self._finish_failed(record, exc)
        self._retire(record.request.request_id)

    async def _run_request(self, record: RequestRecord, program: Program) -> None:
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
        adapters = self._pin_adapters(record)
        try:
            await self._loads.ensure(record.instance, request.task)
            await self._stage_adapters(record, adapters)
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
            if adapters and record.instance.adapters is not None:
                record.instance.adapters.release(adapters, record.instance.device)
            self.scheduler.running.pop(request.request_id, None)
            self._retire(request.request_id)
            for unit in self.scheduler.pending.drop_request(request.request_id):
                if not unit.future.done():
                    unit.future.cancel()
            self._free_slabs(record)
            self.admission.release(request.request_id)
            self._kick()

    @staticmethod
    def _free_slabs(record: RequestRecord) -> None:
        """Free the chunk-KV slabs the ended request still holds (a failed or cancelled rollout never
        closed its window): its reservation goes back to admission now, so its slabs must too."""
        for pool in record.instance.block_pools().values():
            if isinstance(pool, SlabKVPool):
                try:
                    pool.close_owner(record.request.request_id)
                except RuntimeError:  # inside its own training rollout: freed when the rollout exits
                    log.warning("request %s ended inside a training rollout of pool %r", record.request.request_id, pool.name)

    def _pin_adapters(self, record: RequestRecord) -> list[str]:
        """Pin the admitted request's adapter versions on its device: never evicted while it runs
        (admission reserved their bytes). Returns the versions pinned."""
        registry = record.instance.adapters
        versions = list(record.reservation.adapters) if record.reservation is not None else []
        if registry is None or not versions:
            return []
        registry.acquire(versions, record.instance.device)
        return versions

    async def _stage_adapters(self, record: RequestRecord, versions: list[str]) -> None:
        """Bring the request's adapters onto its device before its first step. Reading and
        converting a file (disk to the CPU tier) runs off the device thread, beside other requests'
        steps; the copy to the device is a priced ``cache_io`` unit the scheduler runs between them."""
        instance, registry = record.instance, record.instance.adapters
        assert self._loop is not None
        for version in versions:
            assert registry is not None
            while not registry.resident(version, instance.device):
                key = (instance.instance_id, version)
                shared = self._adapter_loads.get(key)
                if shared is not None:  # another request is loading it: wait for that one load
                    await asyncio.shield(shared)
                    continue  # resident now, unless that load failed: then this request tries itself
                shared = self._adapter_loads[key] = self._loop.create_future()
                try:
                    await asyncio.to_thread(registry.stage, version)
                    size = registry.weight_bytes(version)
                    plan = WorkPlan(
                        loop_id=ADAPTER_LOOP, instance_id=instance.instance_id, kind=WorkKind.CACHE_IO,
                        op=ADAPTER_LOAD_OP, params={"version": version}, shape_sig=ShapeSignature.of(bytes=size),
                        precision="any", tag="adapter load",
                    )
                    await self._enqueue(record, plan)
                finally:
                    self._adapter_loads.pop(key, None)
                    shared.set_result(None)
        # Every entry against the loaded model before the first step: a file for a module this
        # model lacks (an I2V LoRA's k_img on a T2V card) fails this request here, naming the entries.
        for version in versions:
            assert registry is not None
            for component in registry.info_of(version).components:
                module = instance.components.get(component)
                if isinstance(module, nn.Module):
                    registry.weights(version, component, instance.device).check(module)

    def _retire(self, request_id: str) -> None:
        self._store.retire(request_id)

    def forget(self, request_id: str) -> bool:
        """Drop a finished request's record now: its events, artifacts and input tensors (a caller
        holding its handle keeps the result). Returns False if it is unknown or still running."""
        return self._store.forget(request_id)

    def retained(self) -> tuple[int, int]:
        """Finished requests the engine still records, and the tensor bytes they hold."""
        return self._store.retained()

    def _finish_failed(self, record: RequestRecord, exc: BaseException) -> None:
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
    async def _enqueue(self, record: RequestRecord, plan: WorkPlan) -> StepResult:
        if plan.cancel_scope is not CancelScope.NONE:  # a NONE step, once planned, runs even after a cancel
            record.cancel.raise_if_cancelled()
        assert self._loop is not None
        instance = self._by_instance_id.get(plan.instance_id)
        if instance is None:
            raise StepFailed(f"plan names unknown instance {plan.instance_id!r}")
        unit = self.scheduler.work_unit(record, instance, plan, self._loop.create_future())
        self._kick()
        return await unit.future

    async def _settle(self) -> None:
        # Drivers woken by the last batch compute their next plan synchronously; two
        # passes of the event loop let every one of them post it before we pick a batch.
        for _ in range(2):
            await asyncio.sleep(0)

    async def _schedule_forever(self) -> None:
        assert self._wake is not None
        lanes = self.scheduler.lanes
        while True:
            self._wake.clear()
            tick = time.perf_counter()
            self._admit_queued()
            yielded = time.perf_counter()
            await self._settle()
            resumed = time.perf_counter()
            self._admit_queued()
            if len(lanes) > 1:
                started = self._start_lanes(lanes)
                self.metrics.loop_host_seconds += resumed - yielded
                self.metrics.scheduler_seconds += (yielded - tick) + (time.perf_counter() - resumed)
                if not started and not self._lane_runs and self._stopping and not self.scheduler.running:
                    return
                await self._wake.wait()  # new work, or a lane's batch handed back
                continue
            batch = self.scheduler.next_batch()
            self.metrics.loop_host_seconds += resumed - yielded
            self.metrics.scheduler_seconds += (yielded - tick) + (time.perf_counter() - resumed)
            if not batch:
                if self._stopping and not self.scheduler.running:
                    return
                await self._wake.wait()
                continue
            await self._execute(batch)

    def _start_lanes(self, lanes: tuple[Lane, ...]) -> bool:
        """Start a batch on each idle lane that has one ready; whether any started."""
        started = False
        for lane in lanes:
            if lane in self._lane_runs:
                continue
            beside = [peak for other, (_, peak) in self._lane_runs.items() if other != lane]
            batch = self.scheduler.next_batch(lane, beside_peak_bytes=sum(beside) if beside else None)
            if not batch:
                continue
            if beside:
                self.metrics.overlapped_batches += 1
            task = asyncio.create_task(self._run_lane(lane, batch), name=f"fv-lane-{lane}")
            self._lane_runs[lane] = (task, sum(u.plan.resources.peak_bytes for u in batch))
            started = True
        return started

    async def _run_lane(self, lane: Lane, batch: list[WorkUnit]) -> None:
        try:
            await self._execute(batch, lane)
        except Exception:  # noqa: BLE001 - _execute fails units, not the lane; never leave the lane marked busy
            log.exception("lane %s: a batch could not be handed back", lane)
        finally:
            del self._lane_runs[lane]
            self._kick()

    # -- internals: executor --------------------------------------------------------
    async def _execute(self, batch: list[WorkUnit], lane: Lane = "main") -> None:
        """Run a picked batch on the executor, then hand each unit's outcome back to its driver."""
        live = [u for u in batch if not u.future.done()]
        if not live:
            return
        ran, wall = await self.executor.execute(live, lane)
        handed_back = time.perf_counter()
        failed = self.scheduler.hand_back(live, ran.outcomes, ran.device_seconds, wall, self.services,
                                          fused_rows=sum(ran.fused), lane=lane)
        if self.observers:
            self._observe(live, wall, ran.device_seconds, failed, ran.fused)
        self.metrics.scheduler_seconds += time.perf_counter() - handed_back

    def _observe(self, batch: list[WorkUnit], wall: float, device_s: float | None, failed: tuple[str, ...],
                 fused: tuple[bool, ...]) -> None:
        plan = batch[0].plan
        instance = self._by_instance_id[plan.instance_id]
        record = StepRecord(
            instance_id=plan.instance_id, loop_id=plan.loop_id, kind=plan.kind.value, op=plan.op,
            shape_sig=plan.shape_sig, precision=plan.precision,
            request_ids=tuple(u.request_id for u in batch), steps=tuple(u.plan.step_index or 0 for u in batch),
            wall_seconds=wall, device_seconds=device_s, predicted_seconds=sum(u.price_seconds for u in batch),
            cost_spec=instance.step_cost(plan.loop_id), failed=failed, fused=fused,
        )
        for observer in self.observers:
            try:
                observer.on_step(record)
            except Exception:  # noqa: BLE001 - an observer must never take a request down
                log.exception("observer %s failed", getattr(observer, "name", observer))


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
