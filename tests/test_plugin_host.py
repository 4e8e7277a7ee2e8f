"""PluginHost: discovery, deploy-scope selection, failure policy, the hook façade."""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import pytest

from fv_kernel.plugins import (
    DriverTypeError,
    DuplicateContributionError,
    PluginError,
    PluginHost,
    PluginLoadError,
    PluginsConfig,
    PluginStatus,
    PluginWarning,
    UnknownContributionError,
    hookimpl,
)
from fv_kernel.loop.samplers import FlowEulerSampler

from conftest import FIXTURE_PACKAGES


FIXTURES = ["fv-bad", "fv-badcard", "fv-broken", "fv-good", "fv-hello", "fv-oldapi", "fv-toy"]


def make_host(site: Path, config: PluginsConfig | None = None, environ: dict[str, str] | None = None) -> PluginHost:
    return PluginHost(config, search_path=[str(site)], environ=environ or {})


def statuses(host: PluginHost) -> dict[str, str]:
    return {r.name: r.status.value for r in host.records()}


def test_discovery_reads_metadata_only(plugin_site: Path) -> None:
    import sys

    host = make_host(plugin_site)
    assert [p.distribution for p in host.discovered()] == FIXTURES
    assert host.scan() is host.scan()  # scanned once
    assert not any(name.split(".")[0] in FIXTURE_PACKAGES for name in sys.modules)


def test_kernel_builtins_are_read_once_per_scan(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fv_kernel.plugins.host as host_module

    reads: list[int] = []
    real = host_module.scan_kernel_distribution
    monkeypatch.setattr(host_module, "scan_kernel_distribution", lambda: reads.append(1) or real())
    host = make_host(plugin_site)  # the site holds no fv-kernel, so its built-ins come from the kernel's own metadata
    host.start()
    for _ in range(3):
        host.drivers("attention_backends")
    assert len(reads) == 1
    host.refresh()  # forgets the merged scan with the scan
    host.drivers("attention_backends")
    assert len(reads) == 2


def test_autoloaded_broken_plugins_warn_once_and_are_skipped(plugin_site: Path) -> None:
    host = make_host(plugin_site)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        host.start()
    assert statuses(host) == {
        "fv-bad": "enabled", "fv-badcard": "error", "fv-broken": "error", "fv-good": "enabled", "fv-hello": "enabled",
        "fv-kernel": "enabled", "fv-oldapi": "error", "fv-toy": "enabled",
    }
    messages = sorted(str(w.message) for w in caught if issubclass(w.category, PluginWarning))
    assert len(messages) == 3 and all("\n" not in m for m in messages)
    assert "fv-badcard 0.1.0" in messages[0] and "precision.default: Input should be 'fp32'" in messages[0]
    assert "fv-broken 0.3.0" in messages[1] and "RuntimeError: fv_broken exploded at import" in messages[1]
    assert "requires kernel API '>=3.0,<4'" in messages[2] and "provides API version '2.13'" in messages[2]
    assert "fv_broken exploded" in host.record("fv-broken").reason
    assert host.record("fv-good").contributions == {
        "attention_backends": ["fv-good/toy"],
        "transports": ["fv-good/loopback"],
    }
    # historic fv_host_started reached the good plugin, and its firstresult resolver answers
    assert getattr(host, "good_plugin_saw_start", False)
    assert host.hooks.resolve_model_source("toy://x") == "fv-good/toy-card"
    assert host.hooks.resolve_model_source("hub/other") is None


def test_explicitly_enabled_broken_plugin_fails_start(plugin_site: Path) -> None:
    host = make_host(plugin_site, PluginsConfig(enable=["fv-broken"]))
    with pytest.raises(PluginLoadError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        host.start()
    err = info.value
    assert (err.distribution, err.version, err.entry_point) == ("fv-broken", "0.3.0", "fv-broken = fv_broken.plugin")
    assert "fv_broken exploded at import" in str(err) and "fv-broken 0.3.0" in str(err)


def test_explicit_kernel_api_mismatch_names_both_versions(plugin_site: Path) -> None:
    host = make_host(plugin_site, PluginsConfig(autoload=False, enable=["fv-oldapi"]))
    with pytest.raises(PluginLoadError, match=r"requires kernel API '>=3.0,<4', but this kernel provides API version '2\.13'"):
        host.start()


def test_strict_makes_autoload_failures_fatal(plugin_site: Path) -> None:
    with pytest.raises(PluginLoadError, match="fv-broken"):
        make_host(plugin_site, PluginsConfig(strict=True, disable=["fv-oldapi", "fv-badcard"])).start()


def test_enable_disable_by_config(plugin_site: Path) -> None:
    host = make_host(plugin_site, PluginsConfig(autoload=False, enable=["fv-good>=1,<2"], disable=["fv-broken"]))
    host.start()
    assert statuses(host) == {
        **{name: "disabled" for name in FIXTURES}, "fv-good": "enabled", "fv-kernel": "enabled",
    }
    assert host.record("fv-broken").reason == "disabled by 'fv-broken'"
    assert host.enabled_names() == ["fv-good", "fv-kernel"]


def test_enable_with_unsatisfied_version_is_fatal(plugin_site: Path) -> None:
    host = make_host(plugin_site, PluginsConfig(autoload=False, enable=["fv-good>=2"]))
    with pytest.raises(PluginLoadError, match="installed version 1.2.0 does not satisfy"):
        host.start()


def test_enabled_but_not_installed(plugin_site: Path) -> None:
    with pytest.raises(PluginLoadError, match="fv-missing.*not installed"):
        make_host(plugin_site, PluginsConfig(autoload=False, enable=["fv-missing"])).start()
    host = make_host(plugin_site, PluginsConfig(autoload=False, enable=["fv-missing"]))
    host.start(fail_fast=False)
    assert host.record("fv-missing").status is PluginStatus.ERROR


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ("", {**{name: "disabled" for name in FIXTURES}, "fv-kernel": "enabled"}),
        ("fv-good,fv-bad", {**{name: "disabled" for name in FIXTURES}, "fv-bad": "enabled", "fv-good": "enabled", "fv-kernel": "enabled"}),
    ],
)
def test_fv_plugins_env(plugin_site: Path, env: str, expected: dict[str, str]) -> None:
    host = make_host(plugin_site, PluginsConfig(enable=["fv-broken"]), environ={"FV_PLUGINS": env})
    host.start()  # the env replaces the config's explicit enable of fv-broken
    assert statuses(host) == expected


def test_fv_plugins_env_allow_list_is_explicit(plugin_site: Path) -> None:
    with pytest.raises(PluginLoadError, match="fv-broken"):
        make_host(plugin_site, environ={"FV_PLUGINS": "fv-broken"}).start()


def test_start_never_initialises_cuda(plugin_site: Path) -> None:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        make_host(plugin_site).start()
    assert not torch.cuda.is_initialized()


class EulerVariant(FlowEulerSampler):
    name = "euler-variant"


def sampler_plugin(*entries: tuple[str, object]) -> types.ModuleType:
    @hookimpl
    def fv_register_samplers(register):  # noqa: ANN001
        for name, obj in entries:
            register(name, obj)

    module = types.ModuleType("sampler_plugin")
    module.fv_register_samplers = fv_register_samplers  # type: ignore[attr-defined]
    return module


def test_registration_hooks_namespaced_and_checked(fv_host: PluginHost, register_plugin, hook_recorder) -> None:
    register_plugin(sampler_plugin(("euler-variant", EulerVariant)), name="fv-alpha")
    assert hook_recorder.names() == ["fv_register_samplers"]  # run once, when the plugin registered
    found = fv_host.hooks.samplers()
    assert list(found) == ["fv-kernel/euler", "fv-kernel/unipc", "fv-kernel/dmd", "fv-alpha/euler-variant"]
    assert found["fv-alpha/euler-variant"].obj is EulerVariant
    assert fv_host.hooks.get("samplers", "euler-variant").id == "fv-alpha/euler-variant"
    assert hook_recorder.names() == ["fv_register_samplers"]  # lookups never call a plugin
    with pytest.raises(UnknownContributionError, match="no samplers contribution 'nope'; available: fv-alpha/euler-variant, fv-kernel/dmd"):
        fv_host.hooks.get("samplers", "nope")


def test_same_short_name_from_two_plugins_names_both(fv_host: PluginHost, register_plugin) -> None:
    register_plugin(sampler_plugin(("euler-variant", EulerVariant)), name="fv-alpha")
    with pytest.raises(DuplicateContributionError, match="'euler-variant' is contributed by both 'fv-alpha' and 'fv-beta'"):
        register_plugin(sampler_plugin(("euler-variant", EulerVariant)), name="fv-beta")
    # The refused plugin is out entirely; the first keeps working.
    assert statuses(fv_host)["fv-beta"] == "error" and fv_host.pm.get_plugin("fv-beta") is None
    assert fv_host.hooks.get("samplers", "euler-variant").plugin == "fv-alpha"


def test_contribution_must_satisfy_its_base(fv_host: PluginHost, register_plugin) -> None:
    with pytest.raises(DriverTypeError, match=r"fv-weird/weird \(samplers\) must be a subclass of fv_kernel.loop.samplers:Sampler, got dict"):
        register_plugin(sampler_plugin(("weird", dict)), name="fv-weird")
    assert "must be a subclass" in fv_host.record("fv-weird").reason
    assert "fv-weird/weird" not in fv_host.hooks.samplers()


def test_register_twice_is_idempotent_and_late_plugins_see_host_started(fv_host: PluginHost) -> None:
    seen: list[object] = []

    class Late:
        @hookimpl
        def fv_host_started(self, host):  # noqa: ANN001
            seen.append(host)

    late = Late()
    fv_host.register(late, name="fv-late")
    fv_host.register(late, name="fv-late")
    assert seen == [fv_host] and fv_host.pm.get_plugin("fv-late") is late
    assert [fv_host.pm.get_name(p) for p in fv_host.pm.get_plugins()].count("fv-late") == 1
    with pytest.raises(PluginError, match="different plugin object is already registered as 'fv-late'"):
        fv_host.register(Late(), name="fv-late")


def test_hook_contract_is_enforced(fv_host: PluginHost) -> None:
    class Typo:
        @hookimpl
        def fv_register_sampler(self, register):  # noqa: ANN001
            pass

    class PlainWrap:
        @hookimpl
        def fv_wrap_generate(self, request):  # noqa: ANN001
            return "hijacked"

    with pytest.raises(PluginError, match="unknown hook 'fv_register_sampler'"):
        fv_host.register(Typo(), name="fv-typo")
    with pytest.raises(PluginError, match="without wrapper=True"):
        fv_host.register(PlainWrap(), name="fv-plain")
    assert {fv_host.pm.get_name(p) for p in fv_host.pm.get_plugins()} == {"fv-kernel"}  # the built-ins only


def test_wrap_generate_and_lifecycle_broadcasts(fv_host: PluginHost, register_plugin, hook_recorder) -> None:
    class Wrapper:
        @hookimpl(wrapper=True)
        def fv_wrap_generate(self, request):  # noqa: ANN001
            result = yield
            return f"[{result}]"

    register_plugin(Wrapper(), name="fv-wrap")
    assert fv_host.hooks.wrap_generate("req", lambda r: r.upper()) == "[REQ]"
    fv_host.hooks.request_finished("r1", "succeeded")
    fv_host.hooks.step_finished({"step": 1})
    assert hook_recorder.get("fv_request_finished")[0].kwargs == {"request_id": "r1", "status": "succeeded"}
    assert fv_host.hooks.default_model() is None
