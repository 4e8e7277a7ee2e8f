"""Shared fixtures: the fixture plugin distributions exposed as real (uninstalled) metadata.

Each ``tests/fixtures/plugins/<dist>/`` has a pyproject like a real plugin. For the fast
tests they are materialised into one directory as ``<dist>.dist-info`` + package, which
``importlib.metadata`` and the import system treat exactly like installed distributions;
``test_plugin_venv.py`` pip-installs the same folders into a throwaway venv.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Iterator

import pytest

# The kernel's own tests use the conformance kit exactly as a plugin's tests would.
pytest_plugins = ["fv_kernel.testing"]

# Fixture plugins are distributions, not test modules: a fixture's own tests (the tutorial's
# fv-hello/tests) run against that distribution installed, from test_plugin_tutorial.py.
collect_ignore_glob = ["fixtures/*"]

FIXTURE_PLUGINS = Path(__file__).parent / "fixtures" / "plugins"
FIXTURE_PACKAGES = ("fv_good", "fv_broken", "fv_oldapi", "fv_bad", "fv_badcard", "fv_hello", "fv_toy")


def materialise_distribution(source: Path, site: Path) -> None:
    """Write ``source``'s package and a minimal ``.dist-info`` (METADATA, entry_points.txt) into ``site``."""
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    for package in source.iterdir():
        if (package / "__init__.py").is_file():
            shutil.copytree(package, site / package.name)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines.extend(f"{key} = {value}" for key, value in entries.items())
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding every fixture plugin as an importable, discoverable distribution."""
    site = tmp_path_factory.mktemp("fixture_site")
    for source in sorted(FIXTURE_PLUGINS.iterdir()):
        materialise_distribution(source, site)
    return site


def _forget_fixture_modules() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in FIXTURE_PACKAGES:
            del sys.modules[name]


@pytest.fixture
def plugin_site(fixture_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``fixture_site`` on ``sys.path`` for one test; fixture modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(fixture_site))
    importlib.invalidate_caches()
    _forget_fixture_modules()
    yield fixture_site
    _forget_fixture_modules()


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads; on a shared machine they only spin. Results
    depend on the thread count, so a resume test's fresh processes copy this one's (the kit does)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
