"""The DeploymentCard (design §14): what an fv engine tells the fleet about itself.

It rides in the Dynamo model card (``user_data`` and ``runtime_config``'s engine-specific
slot, key :data:`ENGINE_SPECIFIC_KEY`), so a router or planner reading discovery sees the
card, the tasks, the cost model and the SLO without calling the worker. The prices come
from the engine's own :class:`~fv_kernel.api.CostModel` through ``Engine.reservation_for``:
the same conservative GPU-seconds admission reserves, one object with two consumers.
"""

from __future__ import annotations

import math
import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fv_kernel.api import (
    API_VERSION,
    DiffusionParams,
    Engine,
    ModelInstance,
    Request,
    TaskType,
    TextPart,
    __version__,
)

__all__ = [
    "ENGINE_SPECIFIC_KEY",
    "DeploymentCard",
    "SLOSchema",
    "HealthSchema",
    "RolePoolSpec",
    "PricePoint",
    "CardCost",
    "build_deployment_card",
    "price_request",
    "video_frame_ladder",
]

#: The key of the card in ``ModelRuntimeConfig.set_engine_specific`` and in ``user_data``.
ENGINE_SPECIFIC_KEY = "fv_deployment_card"

#: The request classes a price table and an SLO are kept per.
RequestClass = Literal["image", "video"]

_VIDEO_TASKS = (TaskType.TEXT_TO_VIDEO, TaskType.IMAGE_TO_VIDEO)
_IMAGE_TASKS = (TaskType.TEXT_TO_IMAGE,)


def request_class(task: TaskType) -> RequestClass:
    return "image" if task in _IMAGE_TASKS else "video"


class SLOSchema(BaseModel):
    """Latency targets the operator promises per request class (seconds, end to end at the worker)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    p95_latency_s: dict[RequestClass, float] = Field(default_factory=dict)
    #: A worker whose queued GPU-seconds exceed this is saturated: a router should send elsewhere
    #: and a planner should add capacity. None: no bound beyond the engine's own admission.
    max_queued_gpu_seconds: float | None = Field(default=None, gt=0)


class HealthSchema(BaseModel):
    """Where and how the fleet reads this worker's health and live load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The Dynamo endpoint answering ``{"op": "load"}`` / ``{"op": "quote", ...}`` / ``{"op": "card"}``.
    fleet_endpoint: str
    #: Fields a ``load`` answer carries.
    load_fields: tuple[str, ...] = ("queued_gpu_seconds", "requests", "queue_depth", "running", "ready")


class RolePoolSpec(BaseModel):
    """A pool of roles (loops) on devices. fv workers today run every loop colocated (aggregated)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    roles: list[str]
    devices: list[str]


class PricePoint(BaseModel):
    """Predicted GPU-seconds of one request shape: the whole request and each loop's share."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    width: int
    height: int
    frames: int
    steps: int
    gpu_seconds: float
    per_loop: dict[str, float]
    #: Scheduled steps per loop (the engine interleaves running requests step by step).
    steps_per_loop: dict[str, int]


class CardCost(BaseModel):
    """One card's cost model: its loops' declared step costs, a price table and the online calibration."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    loops: dict[str, dict[str, Any]]
    prices: list[PricePoint]
    calibration: list[dict[str, Any]]


class DeploymentCard(BaseModel):
    """Design §14's DeploymentCard, as far as an aggregated fv worker has its parts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_id: str
    kernel_version: str = __version__
    kernel_api: str = API_VERSION
    model_cards: list[str]
    capabilities: dict[str, dict[str, Any]]
    role_pools: list[RolePoolSpec]
    supported_programs: dict[str, list[str]]
    cost_model: list[CardCost]
    health: HealthSchema
    slo: SLOSchema


def _request(instance: ModelInstance, task: TaskType, *, width: int | None = None, height: int | None = None,
             frames: int | None = None) -> Request:
    # A price depends on everything but the prompt; a toy card's vocabulary check would refuse this one's
    # words, so the request may leave the envelope (its shapes come from the card's own capabilities).
    return Request(
        request_id=f"price-{task.value}-{width}x{height}x{frames}", model=instance.model_id, task=task,
        inputs=(TextPart(text="price"),), diffusion=DiffusionParams(width=width, height=height, frames=frames, seed=0),
        allow_outside_envelope=True,
    )


def price_request(engine: Engine, request: Request) -> PricePoint:
    """The conservative GPU-seconds ``request`` would reserve on ``engine`` now, whole and per loop.

    ``request`` is validated first (defaults filled, or the engine's typed error).
    """
    resolved = engine.validate(request)
    instance = engine.instances[resolved.model]
    need = instance.program(resolved.task).estimate(instance, resolved)
    per_loop: dict[str, float] = {}
    steps_per_loop: dict[str, int] = {}
    for step in need.steps:
        spec = instance.card.loops[step.loop_id]
        steps_per_loop[step.loop_id] = steps_per_loop.get(step.loop_id, 0) + step.count
        per_loop[step.loop_id] = per_loop.get(step.loop_id, 0.0) + engine.cost_model.price(
            instance.instance_id, step, spec.step_cost)
    total = engine.reservation_for(resolved).gpu_seconds
    d = resolved.diffusion
    assert d is not None
    return PricePoint(
        task=resolved.task.value, width=int(d.width or 0), height=int(d.height or 0), frames=int(d.frames or 1),
        steps=int(d.steps or 0), gpu_seconds=total, per_loop=per_loop, steps_per_loop=steps_per_loop,
    )


def video_frame_ladder(instance: ModelInstance, count: int = 4) -> list[int]:
    """Up to ``count`` frame counts the card accepts, from its default to its maximum."""
    caps = instance.card.capabilities
    rule = caps.frame_rule
    default = caps.defaults.frames if caps.defaults and caps.defaults.frames else rule.remainder + rule.modulus
    top = caps.max_frames or default
    valid = [f for f in range(default, top + 1) if (f - rule.remainder) % rule.modulus == 0]
    if len(valid) <= count:
        return valid
    stride = (len(valid) - 1) / (count - 1)
    return sorted({valid[math.floor(i * stride + 0.5)] for i in range(count)})


def _price_table(engine: Engine, instance: ModelInstance) -> list[PricePoint]:
    points: list[PricePoint] = []
    for task in instance.card.capabilities.tasks:
        if task in _IMAGE_TASKS:
            points.append(price_request(engine, _request(instance, task)))
        elif task == TaskType.TEXT_TO_VIDEO:
            for frames in video_frame_ladder(instance):
                points.append(price_request(engine, _request(instance, task, frames=frames)))
    return points


def build_deployment_card(
    engine: Engine, *, engine_id: str | None = None, fleet_endpoint: str, slo: SLOSchema | None = None,
) -> DeploymentCard:
    """The card of a running engine's resident instances (prices use the cost model's calibration so far)."""
    instances = engine.instances
    devices = sorted({str(i.device) for i in instances.values()})
    return DeploymentCard(
        engine_id=engine_id or f"{socket.gethostname()}/fv",
        model_cards=sorted(instances),
        capabilities={mid: i.card.capabilities.model_dump(mode="json") for mid, i in instances.items()},
        role_pools=[RolePoolSpec(
            name="aggregated",
            roles=sorted({loop for i in instances.values() for loop in i.card.loops}),
            devices=devices,
        )],
        supported_programs={mid: [t.value for t in i.card.programs] for mid, i in instances.items()},
        cost_model=[
            CardCost(
                model=mid,
                loops={lid: spec.step_cost.model_dump(mode="json") for lid, spec in i.card.loops.items()},
                prices=_price_table(engine, i),
                calibration=[row for row in engine.cost_model.snapshot() if row["instance_id"] == i.instance_id],
            )
            for mid, i in instances.items()
        ],
        health=HealthSchema(fleet_endpoint=fleet_endpoint),
        slo=slo or SLOSchema(),
    )
