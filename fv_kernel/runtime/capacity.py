"""How much of a device's memory the resident instances keep (its size: :mod:`fv_kernel.compute.device`).

The engine sizes the ``"auto"`` memory budget of each device it serves from these:
``total * (1 - headroom) - resident``, where ``resident`` is the bytes of every loaded
weight and buffer of the instances on that device plus the full capacity of their
block pools (a pool's storage is allocated on first use, then kept).
"""

from __future__ import annotations

import asyncio
from typing import Iterable

from fv_kernel.compute.device import device_key, device_total_bytes, module_bytes
from fv_kernel.model.instance import ModelInstance
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.admission import AdmissionController, Budgets

__all__ = ["instance_resident_bytes", "ResidentMemory", "ComponentLoads"]


def instance_resident_bytes(instance: ModelInstance) -> int:
    """What ``instance`` keeps on its device: loaded weights and buffers, and its block pools' capacity."""
    device = instance.device
    weights = sum(module_bytes(component, device) for component in list(instance.components.values()))
    pools = sum(pool.capacity_bytes for pool in instance.block_pools().values())
    return weights + pools


class ResidentMemory:
    """Sizes each device's ``"auto"`` memory budget: total x (1 - headroom) - what resident instances keep.

    The engine tells it about every instance it adds (:meth:`add_instance`, which reads the
    device's total memory once) and every load it runs (:meth:`note_loaded`, on the loading
    thread), and calls :meth:`size` before admitting: it re-sizes only when an instance is
    new or has loaded components since it was last measured (weights load lazily).
    """

    def __init__(self, budgets: Budgets, admission: AdmissionController) -> None:
        self._budgets = budgets
        self._admission = admission
        #: Total memory of each device an instance lives on (sized once, for "auto" budgets).
        self._device_total: dict[str, int] = {}
        #: Per instance id: how many components were loaded when it was measured, and the bytes
        #: they (and its pools) keep. Components are only ever added, so the count marks a change.
        self._resident_cache: dict[str, tuple[int, int]] = {}
        #: (components loaded, resident bytes) measured by a load's own thread, right after it loaded.
        self._resident_measured: dict[str, tuple[int, int]] = {}
        #: Per instance id: its device's key (``device_key``), computed once in :meth:`add_instance`.
        self.device_of: dict[str, str] = {}

    @property
    def auto(self) -> bool:
        return self._budgets.memory_bytes == "auto"

    def add_instance(self, instance: ModelInstance) -> str:
        """Note a new resident instance; returns its device's key. An unsizable device fails here, typed."""
        device = device_key(instance.device)
        if self.auto and device not in self._device_total:
            self._device_total[device] = device_total_bytes(device)
        self.device_of[instance.instance_id] = device
        return device

    def note_loaded(self, instance: ModelInstance) -> None:
        """After a load, on the loading thread: measure what ``instance`` now keeps, so the next
        :meth:`size` need not walk the weights in the scheduler."""
        if self.auto:  # only an "auto" budget subtracts what is resident
            self._resident_measured[instance.instance_id] = (len(instance.components), instance_resident_bytes(instance))

    def size(self, instances: Iterable[ModelInstance]) -> None:
        """Re-size the admission controller's memory capacity of each device, if anything changed."""
        if not self.auto:
            return
        changed = False
        for instance in instances:
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
        headroom = self._budgets.memory_headroom
        resident: dict[str, int] = {}
        for instance_id, (_, kept_bytes) in self._resident_cache.items():
            device = self.device_of[instance_id]
            resident[device] = resident.get(device, 0) + kept_bytes
        for device, total in self._device_total.items():
            usable = int(total * (1.0 - headroom))
            kept = resident.get(device, 0)
            self._admission.set_memory_capacity(
                device, max(usable - kept, 0),
                f"auto: {total} bytes of {device} x (1 - memory_headroom {headroom}) - {kept} bytes "
                "kept by resident instances",
            )


class ComponentLoads:
    """Loads what a task needs off the event loop (weights can take seconds), once per (instance, task).

    Every request that arrives while a load runs awaits the same load and so resumes in the
    same event-loop pass: co-arriving requests post their first steps together and batch. The
    loading thread also measures what the instance now keeps (:meth:`ResidentMemory.note_loaded`),
    so the next admission re-sizes the memory budget without walking the weights in the scheduler.
    """

    def __init__(self, memory: ResidentMemory) -> None:
        self._memory = memory
        #: Loads in flight, one per (instance id, task): co-arriving requests share it.
        self._loads: dict[tuple[str, TaskType], asyncio.Future[None]] = {}

    async def ensure(self, instance: ModelInstance, task: TaskType) -> None:
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
        instance.load_for_task(task)
        self._memory.note_loaded(instance)
