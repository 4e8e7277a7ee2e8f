"""The kernel's built-in plugin, registered through ``fv.plugins`` like any third-party plugin."""

from __future__ import annotations

from fv_kernel.plugins.hookspecs import Register, hookimpl


@hookimpl
def fv_register_samplers(register: Register) -> None:
    # Imported here so that discovering the kernel plugin costs no torch import.
    from fv_kernel.loop.samplers import builtin_samplers

    for name, sampler_cls in builtin_samplers().items():
        register(name, sampler_cls)


@hookimpl
def fv_register_observers(register: Register) -> None:
    from fv_kernel.extend.observers import NaNWatch, ParityAligner

    register("nanwatch", NaNWatch)
    register("parity_aligner", ParityAligner)
