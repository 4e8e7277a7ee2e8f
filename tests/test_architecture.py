"""The dependency rules, checked on the source tree: the kernel imports no plugin, and plugin
modules reach the kernel only through its public API (``fv_kernel.api``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_the_kernel_imports_no_plugin() -> None:
    plugin_packages = {p.name for plugin in (ROOT / "plugins").glob("fv-*") for p in plugin.glob("fv_*") if p.is_dir()}
    assert plugin_packages, "expected plugin packages under plugins/"
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "fv_kernel").rglob("*.py")
        for name in _imports(path)
        if name.split(".")[0] in plugin_packages
    ]
    assert not offenders, offenders


def test_plugin_modules_use_only_the_public_api() -> None:
    offenders = []
    for package in (ROOT / "plugins").glob("fv-*/fv_*"):
        for path in package.rglob("*.py"):
            for name in _imports(path):
                if name.startswith("fv_kernel") and name != "fv_kernel.api":
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders
