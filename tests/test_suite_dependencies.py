"""The kernel's tests that skip without an optional library (the serving hardening, lifecycle and
OpenAPI tests skip without FastAPI, httpx, prometheus-client, schemathesis or PyAV) cannot
vanish from CI: tox's ``kernel`` env installs every library they skip on."""

from __future__ import annotations

import configparser
import re
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def skipped_on() -> dict[str, list[str]]:
    """Module name -> the test files that ``pytest.importorskip`` it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for module in re.findall(r"importorskip\(\s*[\"']([\w.]+)[\"']", path.read_text(encoding="utf-8")):
            found.setdefault(module.split(".")[0], []).append(path.name)
    return found


def _for_the_kernel_env(line: str) -> str | None:
    """The requirement a tox deps line gives the ``kernel`` env (whose one factor is ``kernel``), or
    None: a comment, a substitution, or a line whose factor condition excludes it. A condition is
    tox's: ``a,b:`` either, ``a-b:`` both, ``!a:`` not ``a``."""
    line = line.strip()
    if not line or line.startswith(("#", "{")):
        return None
    condition = re.match(r"([\w,!-]+):\s*(.*)", line)
    if condition is None:
        return line
    factors, requirement = condition.groups()

    def holds(factor: str) -> bool:
        return (factor.lstrip("!") == "kernel") != factor.startswith("!")

    return requirement if any(all(map(holds, group.split("-"))) for group in factors.split(",")) else None


def kernel_env_installs(tox_ini: str) -> set[str]:
    """Distributions (canonical names) the tox ``kernel`` env installs: its deps, the base env's
    deps it includes, and the kernel's ``testing`` extra its commands_pre install."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read_string(tox_ini)
    lines = tox["testenv:kernel"]["deps"].splitlines()
    if "{[testenv]deps}" in lines:
        lines += tox["testenv"]["deps"].splitlines()
    names = {canonicalize_name(Requirement(requirement).name)
             for line in lines if (requirement := _for_the_kernel_env(line)) is not None}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    if "[testing]" in tox["testenv"]["commands_pre"]:
        names |= {canonicalize_name(Requirement(r).name) for r in extras["testing"]}
    return names


def missing_from(tox_ini: str) -> dict[str, list[str]]:
    installed = kernel_env_installs(tox_ini)
    dists = packages_distributions()
    missing = {}
    for module, files in skipped_on().items():
        names = {canonicalize_name(d) for d in dists.get(module, [module])}
        if not names & installed:
            missing[module] = files
    return missing


def test_the_kernel_env_installs_every_library_a_kernel_test_skips_without() -> None:
    found = skipped_on()
    assert {"fastapi", "httpx", "prometheus_client", "schemathesis"} <= set(found), found
    assert "test_serving_hardening.py" in found["prometheus_client"] and "test_serving_lifecycle.py" in found["fastapi"]
    tox_ini = (ROOT / "tox.ini").read_text(encoding="utf-8")
    assert missing_from(tox_ini) == {}


def test_negative_control_a_kernel_env_without_prometheus_client_is_flagged() -> None:
    tox_ini = (ROOT / "tox.ini").read_text(encoding="utf-8")
    without = re.sub(r"(?m)^\s*prometheus-client\S*\n", "", tox_ini)
    assert without != tox_ini
    assert "test_serving_hardening.py" in missing_from(without)["prometheus_client"]
