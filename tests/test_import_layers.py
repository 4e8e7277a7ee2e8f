"""The kernel's layers are import-linter contracts (``[tool.importlinter]`` in pyproject.toml, run
by ``lint-imports`` in the tox env ``imports``). These tests run the same tool: on the tree, where
every contract holds, and on scratch copies with the bug each contract exists to catch put into the
code (an upward import, one only the type checker follows, an import cycle, a plugin reaching past
``fv_kernel.api``, the kernel naming a plugin), where it must fail naming the offending import.
"""

from __future__ import annotations

import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter: tox's kernel env installs it")

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_PACKAGES = sorted(p.parent for p in (ROOT / "plugins").glob("fv-*/fv_*/__init__.py"))


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on ``tree`` (a checkout's layout: fv_kernel/, plugins/fv-*/fv_*/, pyproject.toml)."""
    paths = [str(tree)] + [str(tree / p.relative_to(ROOT).parent) for p in PLUGIN_PACKAGES]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), str(tree / "pyproject.toml"), "--no-cache", "--no-logo"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def scratch_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the kernel and the plugin packages (sources only) with this checkout's contracts."""
    tree = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.safetensors", "*.egg-info")
    shutil.copytree(ROOT / "fv_kernel", tree / "fv_kernel", ignore=ignore)
    for package in PLUGIN_PACKAGES:
        shutil.copytree(package, tree / package.relative_to(ROOT), ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


@pytest.fixture
def tree(scratch_tree: Path, tmp_path: Path) -> Path:
    """A fresh copy of the scratch tree for one test to break."""
    mine = tmp_path / "tree"
    shutil.copytree(scratch_tree, mine)
    return mine


def _append(path: Path, code: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + "\n" + code + "\n", encoding="utf-8")


def test_every_contract_holds_on_the_tree() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_an_upward_import_breaks_the_layers(tree: Path) -> None:
    _append(tree / "fv_kernel" / "card" / "spec.py", "from fv_kernel.runtime.engine import Engine  # noqa")
    done = _lint(tree)
    assert done.returncode != 0
    assert "fv_kernel.card is not allowed to import fv_kernel.runtime" in done.stdout, done.stdout


def test_a_type_checking_import_counts(tree: Path) -> None:
    _append(tree / "fv_kernel" / "loop" / "contract.py",
            "if TYPE_CHECKING:\n    from fv_kernel.model.instance import ModelInstance  # noqa")
    done = _lint(tree)
    assert done.returncode != 0
    assert "fv_kernel.loop is not allowed to import fv_kernel.model" in done.stdout, done.stdout


def test_siblings_of_one_layer_must_not_import_each_other(tree: Path) -> None:
    _append(tree / "fv_kernel" / "program" / "base.py", "from fv_kernel.extend.hooks import RequestHooks  # noqa")
    done = _lint(tree)
    assert done.returncode != 0
    assert "fv_kernel.program is not allowed to import fv_kernel.extend" in done.stdout, done.stdout


def test_a_cycle_inside_a_package_breaks_the_acyclic_contract(tree: Path) -> None:
    _append(tree / "fv_kernel" / "loop" / "plan.py", "from fv_kernel.loop.contract import Loop  # noqa")
    done = _lint(tree)
    assert done.returncode != 0
    assert "no import cycle between the modules of any kernel package BROKEN" in done.stdout, done.stdout


def test_a_plugin_reaching_past_the_api_breaks_its_contract(tree: Path) -> None:
    _append(tree / "plugins" / "fv-wan" / "fv_wan" / "loops.py", "from fv_kernel.loop.plan import WorkPlan  # noqa")
    done = _lint(tree)
    assert done.returncode != 0
    assert "fv_wan.loops -> fv_kernel.loop.plan" in done.stdout, done.stdout


def test_the_kernel_naming_a_plugin_breaks_its_contract(tree: Path) -> None:
    _append(tree / "fv_kernel" / "runtime" / "local.py", "import fv_wan  # noqa")
    done = _lint(tree)
    assert done.returncode != 0
    assert "fv_kernel.runtime.local -> fv_wan" in done.stdout, done.stdout


def test_the_plugins_contract_forbids_every_kernel_plane_but_the_api() -> None:
    """import-linter cannot say "all of fv_kernel but fv_kernel.api": the list must name every child."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["id"] == "plugins-use-the-api")
    children = {f"fv_kernel.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "fv_kernel")])}
    assert set(contract["forbidden_modules"]) == children - {"fv_kernel.api"}
    assert set(contract["source_modules"]) == {p.name for p in PLUGIN_PACKAGES}


def test_the_architecture_picture_is_the_contract() -> None:
    """docs/architecture.md draws the layers contract: each row of its picture is a layer (names,
    then two or more spaces, then what is there), high to low, as in pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["id"] == "kernel-layers")["layers"]
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    picture = text.split("## Layers", 1)[1].split("```", 2)[1].strip("\n").splitlines()
    drawn = [[name.strip() for name in re.split(r"\s{2,}", row.strip())[0].split("|")] for row in picture]
    assert drawn == [[name.strip() for name in layer.split("|")] for layer in layers]
