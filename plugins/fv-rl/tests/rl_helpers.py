"""Shared helpers of fv-rl's RL tests: a wan-tiny instance on a small geometry, engine runs."""

from __future__ import annotations

from typing import Any

from fv_kernel.api import (
    CardCatalog,
    DiffusionParams,
    Engine,
    InstanceOptions,
    OutputSpec,
    Request,
    TaskType,
    TextPart,
    build_instance,
    run_concurrently,
)
from fv_kernel.plugins import PluginHost

GEOMETRY = {"height": 32, "width": 32, "frames": 5}


def host() -> PluginHost:
    h = PluginHost()
    h.start()
    return h


def tiny_instance(card: Any = None) -> Any:
    h = host()
    card = card if card is not None else CardCatalog(h).get("wan-tiny")
    return build_instance(card, InstanceOptions(device="cpu", precision="fp32", registry=h.registry()))


def request(prompt: str = "a red fox", seed: int = 0, capture: str = "off", steps: int = 3, sampler: str | None = None,
            model: str = "wan-tiny") -> Request:
    return Request(
        model=model, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
        diffusion=DiffusionParams(steps=steps, guidance=1.0, seed=seed, sampler=sampler, **GEOMETRY),
        output=OutputSpec(capture_behavior=capture),  # type: ignore[arg-type]
    )


#: Submit every request at once and wait for all: the kernel's own helper (the gate's interleaved side).
run = run_concurrently


def engine_for(instance: Any, **kwargs: Any) -> Engine:
    engine = Engine(**kwargs)
    engine.add_instance(instance)
    return engine
