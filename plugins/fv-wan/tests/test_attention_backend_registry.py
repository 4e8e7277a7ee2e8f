"""fv-wan resolves the deployment's attention backend through the deploy registry its instance carries.

A backend of an enabled plugin is used by name; one the deployment does not enable is
refused naming why, even when it is installed.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any

import pytest
import torch

from fv_kernel.api import InstanceOptions, build_instance
from fv_kernel.compute.attention import SDPAAttention
from fv_kernel.plugins.drivers import DriverRegistry
from fv_kernel.plugins.errors import UnknownDriverError
from fv_kernel.plugins.registry import DeployRegistry, kernel_registry

CALLS: list[tuple[int, ...]] = []


class CountingAttention(SDPAAttention):
    """A plugin's backend: softmax attention that records every call."""

    name = "counting"

    def attend(self, q, k, v, **kwargs):  # noqa: ANN001, ANN003, ANN201
        CALLS.append(tuple(q.shape))
        return super().attend(q, k, v, **kwargs)


def registry_with_counting() -> DeployRegistry:
    entry = EntryPoint("counting", f"{__name__}:CountingAttention", "fv.attention_backends")
    return kernel_registry().replace(attention_backends=DriverRegistry("attention_backends", [entry]))


def forward(instance) -> torch.Tensor:  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(1, 16, 3, 8, 6, generator=g), "t": torch.tensor([900.0]),
              "context": torch.randn(1, 10, 32, generator=g)}
    with torch.no_grad():
        return instance.op("dit_forward:transformer").fn(inputs, {})["v"]


def test_wan_runs_the_backend_its_deploy_registry_names(wan_card: Any) -> None:
    card = wan_card("wan-tiny")
    CALLS.clear()
    tuned = build_instance(card, InstanceOptions(attention_backend="counting", registry=registry_with_counting()))
    tuned.component("transformer")
    got = forward(tuned)
    assert CALLS, "the deployment's backend was never called"
    default = build_instance(card, InstanceOptions())
    default.component("transformer")
    torch.testing.assert_close(got, forward(default), rtol=1e-5, atol=1e-5)


def test_wan_refuses_a_backend_its_deployment_does_not_enable(wan_card: Any) -> None:
    card = wan_card("wan-tiny")
    left_out = kernel_registry().replace(attention_backends=DriverRegistry(
        "attention_backends", [], ignored={"counting": "its distribution 'fv-counting' is not an enabled fv plugin"}))
    instance = build_instance(card, InstanceOptions(attention_backend="counting", registry=left_out))
    with pytest.raises(UnknownDriverError, match="'counting' was left out: its distribution 'fv-counting' is not an enabled fv plugin"):
        instance.component("transformer")
    # No registry at all: only the kernel's own drivers, never whatever happens to be installed.
    bare = build_instance(card, InstanceOptions(attention_backend="counting"))
    with pytest.raises(UnknownDriverError, match="no attention_backends driver named 'counting'"):
        bare.component("transformer")


def test_wan_runs_a_plugin_sampler_the_request_names(wan_card: Any) -> None:
    """docs/plugins.md: `fv generate --model wan-tiny --sampler euler-shift3` runs the default denoise loop with it."""
    import types

    from fv_kernel.api import DiffusionParams, FlowEulerSampler, Request, TaskType, TextPart, hookimpl, run_local
    from fv_kernel.plugins import PluginHost

    class EulerShift3(FlowEulerSampler):
        name = "euler-shift3"
        shift: float = 3.0

    @hookimpl
    def fv_register_samplers(register):  # noqa: ANN001, ANN202
        register("euler-shift3", EulerShift3)

    plugin = types.ModuleType("fv_hello_like")
    plugin.fv_register_samplers = fv_register_samplers  # type: ignore[attr-defined]
    host = PluginHost(discover=False, environ={})
    host.start()
    host.register(plugin, name="fv-hello")
    card = wan_card("wan-tiny")
    instance = build_instance(card, InstanceOptions(registry=host.registry()))

    def frames(**diffusion: object) -> torch.Tensor:
        request = Request(model="wan-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a red ball"),),
                          diffusion=DiffusionParams(steps=2, frames=1, height=16, width=16, seed=0, **diffusion))
        (video,) = [a for a in run_local(request, instance) if a.kind == "video"]
        return video.frames

    plugin_run = frames(sampler="euler-shift3")
    assert torch.equal(plugin_run, frames(sampler="euler", shift=3.0))
    assert not torch.equal(plugin_run, frames())  # wan-tiny's own loop runs unipc
