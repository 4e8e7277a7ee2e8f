"""What admitting a request reserves: its program's whole-life estimate, priced (design §6.1, §6.2).

The program's estimate (``Program.estimate``: every loop's steps, resident and peak bytes,
block-pool blocks) becomes a :class:`~fv_kernel.runtime.admission.Reservation`: its steps
priced by the calibrated cost model (the Profiler's correction times the spec's
conservative factor), its pool blocks keyed by the engine-wide pool key, on the
instance's device.
"""

from __future__ import annotations

from fv_kernel.loop.samplers import use_samplers
from fv_kernel.loop.plan import ResourceRequest, ShapeSignature, WorkKind
from fv_kernel.model.instance import ADAPTER_LOAD_COST, ModelInstance
from fv_kernel.request.request import Request
from fv_kernel.runtime.admission import Reservation
from fv_kernel.runtime.cost import CostKey, CostModel

__all__ = ["pool_key", "price_estimate", "reservation_for", "adapter_load_key"]


def adapter_load_key(instance: ModelInstance, size_bytes: int) -> CostKey:
    """The cost-model key of copying an adapter of ``size_bytes`` to ``instance``'s device."""
    return CostKey(instance.instance_id, WorkKind.CACHE_IO.value, ShapeSignature.of(bytes=size_bytes), "any")


def pool_key(instance: ModelInstance, name: str) -> str:
    """The engine-wide key of ``instance``'s block pool ``name`` (``"<instance id>/<pool>"``)."""
    return f"{instance.instance_id}/{name}"


def reservation_for(instance: ModelInstance, request: Request, cost_model: CostModel, *, device: str) -> Reservation:
    """What admitting ``request`` (resolved against ``instance``) reserves now, on ``device``."""
    # An estimate may build the request's sampler (a loop prices its steps by its timesteps): names
    # resolve through the instance's deploy registry, plugins' samplers included, as in the driver.
    with use_samplers(instance.registry.samplers):
        need = instance.program(request.task).estimate(instance, request)
    return price_estimate(instance, request, need, cost_model, device=device)


def price_estimate(
    instance: ModelInstance, request: Request, need: ResourceRequest, cost_model: CostModel, *, device: str,
) -> Reservation:
    """``need`` (a program's or one loop's whole-life estimate for ``request``) as a reservation on ``device``."""
    seconds = need.gpu_seconds or 0.0
    for step in need.steps:
        spec = instance.card.loops.get(step.loop_id)
        if spec is None:
            raise ValueError(f"an estimate of {instance.model_id!r} prices steps of unknown loop {step.loop_id!r}")
        seconds += cost_model.price(instance.instance_id, step, spec.step_cost)
    pools = instance.block_pools()
    pool_blocks: dict[str, int] = {}
    for name, blocks in need.pool_blocks.items():
        if name not in pools:
            raise ValueError(f"an estimate of {instance.model_id!r} reserves blocks of pool {name!r}; "
                             f"the instance has {sorted(pools) or 'no pools'}")
        pool_blocks[pool_key(instance, name)] = blocks
    adapters = {info.version: info.weight_bytes for info, _ in instance.adapter_stack(request)}
    registry = instance.adapters
    for version, size in adapters.items():
        if registry is not None and not registry.resident(version, instance.device):
            seconds += cost_model.conservative(adapter_load_key(instance, size), ADAPTER_LOAD_COST)
    return Reservation(
        request.request_id, need.resident_bytes, need.peak_bytes, need.cache_blocks, seconds,
        pool_blocks=pool_blocks, device=device, adapters=adapters,
    )
