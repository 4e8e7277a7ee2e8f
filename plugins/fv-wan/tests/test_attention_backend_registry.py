"""fv-wan resolves the deployment's attention backend through the deploy registry its instance carries.

A backend of an enabled plugin is used by name; one the deployment does not enable is
refused naming why, even when it is installed.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
import torch

from fv_kernel.api import InstanceOptions, build_instance
from fv_kernel.compute.attention import SDPAAttention
from fv_kernel.plugins.drivers import DriverRegistry
from fv_kernel.plugins.errors import UnknownDriverError
from fv_kernel.plugins.registry import DeployRegistry, kernel_registry
from fv_wan.cards import wan_cards

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


def test_wan_runs_the_backend_its_deploy_registry_names() -> None:
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    CALLS.clear()
    tuned = build_instance(card, InstanceOptions(attention_backend="counting", registry=registry_with_counting()))
    tuned.component("transformer")
    got = forward(tuned)
    assert CALLS, "the deployment's backend was never called"
    default = build_instance(card, InstanceOptions())
    default.component("transformer")
    torch.testing.assert_close(got, forward(default), rtol=1e-5, atol=1e-5)


def test_wan_refuses_a_backend_its_deployment_does_not_enable() -> None:
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    left_out = kernel_registry().replace(attention_backends=DriverRegistry(
        "attention_backends", [], ignored={"counting": "its distribution 'fv-counting' is not an enabled fv plugin"}))
    instance = build_instance(card, InstanceOptions(attention_backend="counting", registry=left_out))
    with pytest.raises(UnknownDriverError, match="'counting' was left out: its distribution 'fv-counting' is not an enabled fv plugin"):
        instance.component("transformer")
    # No registry at all: only the kernel's own drivers, never whatever happens to be installed.
    bare = build_instance(card, InstanceOptions(attention_backend="counting"))
    with pytest.raises(UnknownDriverError, match="no attention_backends driver named 'counting'"):
        bare.component("transformer")
