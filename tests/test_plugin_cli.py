"""``fv version`` and ``fv plugins list/check`` through Typer's CliRunner, broken plugins included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fv_kernel import API_VERSION, __version__
from fv_kernel.cli.app import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_env_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FV_PLUGINS", raising=False)


def test_version_and_help() -> None:
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"fv-kernel {__version__} (plugin API {API_VERSION})"
    assert runner.invoke(app, ["plugins", "--help"]).exit_code == 0
    assert "list" in runner.invoke(app, ["plugins", "--help"]).stdout


def test_list_survives_broken_plugins(plugin_site: Path) -> None:
    result = runner.invoke(app, ["plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["fv-kernel"]["status"] == "enabled"
    assert rows["fv-good"]["status"] == "enabled"
    assert rows["fv-good"]["contributions"]["attention_backends"] == ["fv-good/toy"]
    assert rows["fv-broken"]["status"] == "error" and "fv_broken exploded at import" in rows["fv-broken"]["reason"]
    assert rows["fv-oldapi"]["status"] == "error" and "'>=3.0,<4'" in rows["fv-oldapi"]["reason"]
    assert rows["fv-badcard"]["status"] == "error" and "precision.default" in rows["fv-badcard"]["reason"]
    assert rows["fv-hello"]["registered"] == {
        "samplers": ["fv-hello/euler-shift3"], "attention_backends": ["fv-hello/hello-math"],
    }
    assert rows["fv-badcard"]["registered"] == {}  # unregistered: none of its hooks count
    assert result.stderr.count("warning: fv: skipped plugin") == 3


def test_list_table_with_config(plugin_site: Path, tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text("plugins: {autoload: false, enable: [fv-hello]}\n")
    result = runner.invoke(app, ["plugins", "list", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "fv-good 1.2.0  [disabled]  not enabled (autoload is off)" in result.stdout
    # The tutorial's promise (docs/plugins.md, step 4), with the contributions it names.
    assert "fv-hello 0.1.0  [enabled]  enabled by 'fv-hello'" in result.stdout
    assert "    samplers: fv-hello/euler-shift3" in result.stdout
    assert "    attention_backends: fv-hello/hello-math" in result.stdout


def test_check_passes_on_good_plugin(plugin_site: Path) -> None:
    result = runner.invoke(app, ["plugins", "check", "fv-good", "--no-side-effects"])
    assert result.exit_code == 0, result.output
    assert "fv-good: all checks passed" in result.stdout


def test_check_fails_with_reasons(plugin_site: Path) -> None:
    bad = runner.invoke(app, ["plugins", "check", "fv-bad", "--no-side-effects"])
    assert bad.exit_code == 1
    assert "FAIL contributions" in bad.stdout
    assert "manifest declares transports 'ghost', but it is not declared as an entry point in group fv.transports" in bad.stdout
    assert "must be a subclass of fv_kernel.compute.attention:AttentionBackend, got NotABackend" in bad.stdout
    broken = runner.invoke(app, ["plugins", "check", "fv-broken", "--no-side-effects"])
    assert broken.exit_code == 1 and "RuntimeError: fv_broken exploded at import" in broken.stdout
    # the checks that could not run after the import failed say so in one line each, not the error again
    assert "  skip register_twice (import check failed)" in broken.stdout
    assert broken.stdout.count("exploded at import") == 1
    missing = runner.invoke(app, ["plugins", "check", "fv-nowhere", "--no-side-effects"])
    assert missing.exit_code == 1 and "no 'fv.plugins' entry point for distribution 'fv-nowhere'" in missing.stderr
