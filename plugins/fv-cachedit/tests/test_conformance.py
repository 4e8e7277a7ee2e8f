"""Plugin conformance for fv-cachedit, and the deploy path: a deploy config's ``extensions:``
enables the caches through the installed plugin, and conflicting ones are refused there."""

from __future__ import annotations

import pytest

from fv_kernel.config import DeployConfig
from fv_kernel.extend.registry import ExtensionConfigError
from fv_kernel.plugins.config import PluginsConfig
from fv_kernel.plugins.host import PluginHost
from fv_kernel.deploy.options import available_extensions
from fv_kernel.deploy.engine import build_engine
from fv_kernel.testing import PluginConformance

pytest_plugins = ["fv_kernel.testing"]


class TestCachedItPlugin(PluginConformance):
    distribution = "fv-cachedit"


def _host() -> PluginHost:
    return PluginHost(PluginsConfig(autoload=False, enable=["fv-cachedit", "fv-wan"]), environ={})


def test_the_installed_plugin_contributes_the_interceptors() -> None:
    from fv_cachedit import DBCache, FBCache, StepSkip, TaylorSeer

    found = available_extensions(_host())
    for cls in (DBCache, FBCache, TaylorSeer, StepSkip):
        assert found[cls.plugin_id] is cls


def test_deploy_config_enables_a_cache_and_refuses_conflicts() -> None:
    fbcache = {"default_on": True, "config": {"residual_diff_threshold": 0.1, "max_warmup_steps": 2}}
    engine = build_engine(DeployConfig.model_validate({"cards": [{"model": "wan-tiny"}], "extensions": {"fbcache": fbcache}}), _host())
    interceptor = engine.extensions.interceptors["fbcache"]
    assert interceptor.config.residual_diff_threshold == 0.1 and interceptor.config.fn_compute_blocks == 1
    clash = DeployConfig.model_validate({"cards": [{"model": "wan-tiny"}], "extensions": {"fbcache": fbcache, "taylorseer": {}}})
    with pytest.raises(ExtensionConfigError, match="conflicts with"):
        build_engine(clash, _host())
    fastwan_default_skip = DeployConfig.model_validate({
        "cards": [{"model": "fastwan-tiny"}], "extensions": {"step-skip": {"default_on": True}},
    })
    with pytest.raises(ExtensionConfigError, match="refuses step_skip"):
        build_engine(fastwan_default_skip, _host())
