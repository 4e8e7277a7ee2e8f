"""End to end in a real, throwaway venv: pip-install fixture plugins, then run the ``fv`` CLI.

The one slow-ish module: ``--system-site-packages`` reuses torch and the kernel, and
``--no-deps --no-build-isolation`` keeps pip offline.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

from conftest import FIXTURE_PLUGINS


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(root)
    python = root / "bin" / "python"
    # When this interpreter is itself a venv, --system-site-packages reaches only the base
    # interpreter; chain our site-packages (and its .pth files, e.g. an editable kernel) too.
    purelib = Path(sysconfig.get_paths(vars={"base": str(root), "platbase": str(root)})["purelib"])
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "_fv_parent_env.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
    for dist in ("fv-good", "fv-broken", "fv-badcard", "fv-toy"):
        # A copy, so the build never writes into the source tree.
        src = root / "src" / dist
        shutil.copytree(FIXTURE_PLUGINS / dist, src)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(src)],
            check=True,
            capture_output=True,
            timeout=300,
        )
    return python


def fv(python: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if k != "FV_PLUGINS"}, **(env or {})}
    return subprocess.run(
        [str(python), "-m", "fv_kernel.cli.app", *args], capture_output=True, text=True, env=env, timeout=300, cwd="/"
    )


def test_installed_plugins_are_discovered_and_broken_one_only_warns(plugin_venv: Path) -> None:
    result = fv(plugin_venv, "plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["fv-good"]["status"] == "enabled" and rows["fv-good"]["version"] == "1.2.0"
    assert rows["fv-broken"]["status"] == "error"
    assert rows["fv-badcard"]["status"] == "error" and "precision.default" in rows["fv-badcard"]["reason"]
    warning_lines = [ln for ln in result.stderr.splitlines() if "skipped plugin" in ln]
    assert len(warning_lines) == 2 and "fv-broken 0.3.0" in warning_lines[1] and "fv-badcard 0.1.0" in warning_lines[0]
    assert "Traceback" not in result.stderr


def test_installed_bad_card_plugin_leaves_the_others_working(plugin_venv: Path) -> None:
    listed = fv(plugin_venv, "cards", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert "toy-dit" in [row["model_id"] for row in json.loads(listed.stdout)]
    assert "warning: fv: skipped plugin fv-badcard 0.1.0: plugin 'fv-badcard' failed in fv_register_model_cards" in listed.stderr
    # Enabled explicitly, the same plugin stops the command with one line.
    env_selected = fv(plugin_venv, "cards", "list", env={"FV_PLUGINS": "fv-toy,fv-badcard"})
    assert env_selected.returncode == 2 and env_selected.stdout == ""
    assert env_selected.stderr.count("\n") == 1 and env_selected.stderr.startswith("error: plugin fv-badcard 0.1.0")


def test_installed_good_plugin_passes_check(plugin_venv: Path) -> None:
    result = fv(plugin_venv, "plugins", "check", "fv-good")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fv-good: all checks passed" in result.stdout
