"""Admission prices a request with its loops' estimates; an estimate that builds the request's
sampler (fv-wan's denoise loop does: it prices steps by their timesteps) must resolve a plugin
sampler through the instance's deploy registry, as the driver does, or every request naming a
plugin sampler fails at admission."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import pytest

from fv_kernel.api import DiffusionParams, Engine, InstanceOptions, Request, TaskType, TextPart, build_instance
from fv_kernel.plugins import PluginHost, PluginsConfig, PluginWarning
from fv_kernel.testing.toy import ToyDenoiseLoop, toy_card


def _registry(site: Path) -> Any:
    host = PluginHost(PluginsConfig(autoload=False, enable=["fv-hello"]), search_path=[str(site)], environ={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        host.start()
    return host.registry()


@pytest.fixture
def estimate_builds_the_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ToyDenoiseLoop.estimate

    def estimate(self: ToyDenoiseLoop, request: Request, model: Any) -> Any:
        d = request.diffusion
        self._sampler(d.shift, d.sampler).init_state(d.steps or 1)  # as fv-wan's estimate does
        return original(self, request, model)

    monkeypatch.setattr(ToyDenoiseLoop, "estimate", estimate)


def _run(site: Path) -> str:
    engine = Engine()
    engine.add_instance(build_instance(toy_card("toy-dit"), InstanceOptions(registry=_registry(site))))
    request = Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a red ball"),),
                      diffusion=DiffusionParams(seed=3, sampler="euler-shift3"))
    result = engine.generate(request)
    return result.status if result.error is None else f"{result.status}: {result.error.message}"


def test_admission_resolves_a_plugin_sampler(plugin_site: Path, estimate_builds_the_sampler: None) -> None:
    assert _run(plugin_site) == "completed"


def test_negative_control_without_the_registry_admission_fails(
    plugin_site: Path, estimate_builds_the_sampler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fv_kernel.runtime.pricing as pricing_module  # where admission prices a request

    monkeypatch.setattr(pricing_module, "use_samplers", lambda samplers: contextlib.nullcontext())
    outcome = _run(plugin_site)
    assert outcome != "completed" and "'euler-shift3' is not registered in this deployment" in outcome, outcome
