"""Manifest and deploy-config validation: typed errors that name the field and the allowed values."""

from __future__ import annotations

from pathlib import Path

import pytest

from fv_kernel.plugins import (
    KernelAPIMismatchError,
    ManifestError,
    PluginConfigError,
    PluginsConfig,
    load_manifest,
    locate_manifest,
)
from fv_kernel.config import DeployConfigError, load_deploy_config
from fv_kernel.plugins.config import select
from fv_kernel.plugins.manifest import parse_manifest

GOOD = {"name": "fv-x", "version": "1.0.0", "kernel_api": ">=2.0,<3", "contributions": {"samplers": [{"name": "s"}]}}


def test_manifest_ids_are_namespaced() -> None:
    manifest = parse_manifest(GOOD, source="t")
    assert manifest.contribution_ids() == {"samplers": ["fv-x/s"]}


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"contributions": {"widgets": []}}, "unknown contribution kind 'widgets'; allowed: model_cards"),
        ({"kernel_api": "one point oh"}, "kernel_api: Value error, kernel_api 'one point oh' is not a PEP 440 specifier"),
        ({"colour": "red"}, "colour: Extra inputs are not permitted"),
        ({"contributions": {"samplers": [{"name": "a"}, {"name": "a"}]}}, "declares a more than once"),
        ({"contributions": {"samplers": [{"name": "a", "target": "no colon"}]}}, "contributions.samplers.0.target"),
    ],
)
def test_invalid_manifest_names_the_field(patch: dict, needle: str) -> None:
    with pytest.raises(ManifestError, match="invalid manifest") as info:
        parse_manifest({**GOOD, **patch}, source="fv-plugin.yaml")
    assert needle in str(info.value)


def test_kernel_api_mismatch_names_both_versions() -> None:
    manifest = parse_manifest({**GOOD, "kernel_api": ">=2.0,<3"}, source="t")
    with pytest.raises(KernelAPIMismatchError) as info:
        manifest.check_kernel_api("1.0")
    assert "'>=2.0,<3'" in str(info.value) and "'1.0'" in str(info.value) and "fv-x" in str(info.value)
    manifest.check_kernel_api("2.5")


def test_manifest_must_describe_its_distribution() -> None:
    manifest = parse_manifest(GOOD, source="t")
    manifest.check_distribution("FV_X", "1.0")  # canonical name, equal PEP 440 version
    with pytest.raises(ManifestError, match="manifest name 'fv-x' does not match distribution name 'fv-y'"):
        manifest.check_distribution("fv-y", "1.0.0")
    with pytest.raises(ManifestError, match="does not match distribution version '1.1'"):
        manifest.check_distribution("fv-x", "1.1")


def test_manifest_is_located_without_importing_the_plugin(plugin_site: Path) -> None:
    import sys

    path = locate_manifest("fv_broken.plugin")  # importing fv_broken.plugin would raise
    assert path == plugin_site / "fv_broken" / "fv-plugin.yaml"
    assert load_manifest(path).name == "fv-broken"
    assert "fv_broken" not in sys.modules and "fv_broken.plugin" not in sys.modules
    with pytest.raises(ManifestError, match="package 'fv_nowhere'"):
        locate_manifest("fv_nowhere.plugin")


def test_kernel_manifest_tracks_kernel_version() -> None:
    import fv_kernel

    manifest = load_manifest(Path(fv_kernel.__file__).with_name("fv-plugin.yaml"))
    manifest.check_distribution("fv-kernel", fv_kernel.__version__)
    manifest.check_kernel_api(fv_kernel.API_VERSION)


def test_the_deploy_config_reads_the_plugins_section_strictly(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("cards: [toy-dit]\nplugins:\n  autoload: false\n  enable: ['fv-good>=1,<2']\n  strict: true\n")
    config = load_deploy_config(path).plugins
    assert config == PluginsConfig(autoload=False, enable=["fv-good>=1,<2"], strict=True)
    (tmp_path / "empty.yaml").write_text("cards: []\n")
    assert load_deploy_config(tmp_path / "empty.yaml").plugins == PluginsConfig()
    # The whole file goes through the deploy config's strict loader: other sections' unknown keys are errors too.
    (tmp_path / "extra.yaml").write_text("engine: {gpus: 1}\nplugins: {autoload: false}\n")
    with pytest.raises(DeployConfigError, match="engine: Extra inputs are not permitted"):
        load_deploy_config(tmp_path / "extra.yaml").plugins


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("plugins: {autoload: maybe}", "plugins.autoload"),
        ("plugins: {enable: ['fv-good >>> 1']}", "plugins.enable"),
        ("plugins: {enable: [a], disable: [a]}", "both enable and disable: a"),
        ("plugins: {disable: [fv-kernel]}", "cannot be disabled"),
        ("plugins: {enabled: [a]}", "plugins.enabled: Extra inputs are not permitted"),
        ("- just a list", "must be a mapping at the top level"),
    ],
)
def test_bad_config_is_a_typed_error(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(body)
    with pytest.raises(DeployConfigError) as info:
        load_deploy_config(path).plugins
    assert needle in str(info.value) and str(path) in str(info.value)


def test_selection_rules() -> None:
    config = PluginsConfig(enable=["fv-a>=1,<2"], disable=["fv-b"])
    assert select(config, "fv-a", "1.5").explicit
    assert select(config, "fv-a", "2.0").problem == "installed version 2.0 does not satisfy the enable selector 'fv-a<2,>=1'"
    assert not select(config, "fv-b", "9").enabled
    assert select(config, "fv-c", "1").enabled and not select(config, "fv-c", "1").explicit
    assert not select(PluginsConfig(autoload=False), "fv-c", "1").enabled
    assert select(PluginsConfig(autoload=False), "fv-kernel", "0.1.0").enabled


def test_fv_plugins_env_override() -> None:
    base = PluginsConfig(enable=["fv-a"], disable=["fv-b"])
    assert base.with_env({}) is base
    none = base.with_env({"FV_PLUGINS": ""})
    assert not select(none, "fv-a", "1").enabled and not select(none, "fv-c", "1").enabled
    allow = base.with_env({"FV_PLUGINS": " fv-b , fv-c"})
    assert select(allow, "fv-b", "1").explicit and select(allow, "fv-c", "1").enabled
    assert not select(allow, "fv-a", "1").enabled
    with pytest.raises(PluginConfigError, match="FV_PLUGINS"):
        base.with_env({"FV_PLUGINS": "fv-a[extra]"})


def test_per_plugin_settings_are_read_by_name(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("plugins:\n  settings:\n    Fv_Good: {models: m.yaml, n: 3}\n")
    config = load_deploy_config(path).plugins
    assert config.settings_for("fv-good") == {"models": "m.yaml", "n": 3}  # canonical name match
    assert config.settings_for("fv-other") == {}
    # FV_PLUGINS replaces the selection, never the settings
    assert config.with_env({"FV_PLUGINS": "fv-good"}).settings_for("fv-good") == {"models": "m.yaml", "n": 3}


@pytest.mark.parametrize(("settings", "needle"), [
    ({"fv good": {}}, "'fv good' is not a distribution name"),
    ({"fv-good>=1": {}}, "is not a distribution name"),
    ({"fv-good": {}, "fv_good": {}}, "'fv-good' and 'fv_good' name the same plugin"),
    ({"fv-good": 3}, "settings.fv-good"),
])
def test_bad_plugin_settings_name_the_field(tmp_path: Path, settings: dict, needle: str) -> None:
    import yaml

    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"plugins": {"settings": settings}}))
    with pytest.raises(DeployConfigError, match="plugins.settings") as caught:
        load_deploy_config(path).plugins
    assert needle in str(caught.value)


def test_settings_for_a_plugin_that_is_not_installed_stop_the_host(plugin_site: Path) -> None:
    import warnings

    from fv_kernel.plugins import PluginHost, PluginWarning

    typo = PluginsConfig(settings={"fv-goood": {"x": 1}})
    with pytest.raises(PluginConfigError, match="plugins.settings names 'fv-goood', which is not installed; installed: .*fv-good"):
        PluginHost(typo, environ={}).start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginWarning)
        PluginHost(typo, environ={}).start(fail_fast=False)
    assert any("fv-goood" in str(w.message) for w in caught if issubclass(w.category, PluginWarning))
    # Negative control: settings for an installed plugin (enabled or not) start fine.
    PluginHost(PluginsConfig(settings={"fv-good": {"x": 1}}, autoload=False), environ={}).start()
    host = PluginHost(PluginsConfig(settings={"fv-good": {"x": 1}}, autoload=False, enable=["fv-good"]), environ={})
    host.start()
    assert host.config.settings_for("fv-good") == {"x": 1}
