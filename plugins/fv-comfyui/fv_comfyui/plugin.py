"""fv-comfyui's plugin module, registered under the ``fv.plugins`` entry point.

Kept light: the sampler classes (and torch) are imported only when the host asks.
"""

from __future__ import annotations

from typing import Any

from fv_kernel.api import hookimpl


@hookimpl
def fv_register_samplers(register: Any) -> None:
    from fv_comfyui.samplers import COMFY_SAMPLERS

    for sampler in COMFY_SAMPLERS:
        register(sampler.name, sampler)


@hookimpl
def fv_serving_routes(app: Any, engine: Any, config: Any) -> None:
    """ComfyUI's HTTP surface on ``fv serve`` (``POST /prompt``, ``/history``, ``/view``, ``/ws``...)."""
    from fv_comfyui.serving import mount

    mount(app, engine, config)
