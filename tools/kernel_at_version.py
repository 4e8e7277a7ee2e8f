#!/usr/bin/env python3
"""Install (or locate) fv-kernel at the oldest version a plugin declares.

    python tools/kernel_at_version.py plugins/fv-wan            # print the kernel source dir
    python tools/kernel_at_version.py --install plugins/fv-wan  # and pip-install it
    python tools/kernel_at_version.py --run plugins/fv-cosmos3 --also 'plugins/fv-wan[test]' -- python -m pytest tests -q

``--run`` is the kmin test env: when the plugin's minimum is an older kernel, it installs the
``--first`` requirements (the pinned torch, so the kernel's own ``torch`` requirement cannot pull
another build), that kernel, the ``--also`` projects and the plugin (``[test]``), then runs the
command. When the minimum *is* the current kernel there is nothing older to check: the kcur env
runs the same tests against the same kernel, so it says so and installs and runs nothing (the
tox env holds only what this tool needs until then).

The minimum is the lower bound of the plugin's ``fv-kernel`` requirement (``>=X``,
``==X``, ``~=X``). When X equals the current kernel version the working tree is used
(editable); otherwise the git tag ``fv-kernel-vX`` is exported with ``git archive``
into a temporary directory and installed from there.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
KERNEL = "fv-kernel"


class KernelVersionError(RuntimeError):
    """The plugin's kernel requirement or the requested kernel tag is unusable."""


def _project(pyproject: Path) -> dict:
    return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]


def minimum_kernel_version(plugin_dir: Path) -> Version:
    """Lower bound of the plugin's ``fv-kernel`` requirement."""
    for text in _project(plugin_dir / "pyproject.toml").get("dependencies", []):
        req = Requirement(text)
        if canonicalize_name(req.name) != KERNEL:
            continue
        lower = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
        if not lower:
            raise KernelVersionError(f"{plugin_dir}: requirement {text!r} has no lower bound (use fv-kernel>=X)")
        return max(lower)
    raise KernelVersionError(f"{plugin_dir}/pyproject.toml does not depend on {KERNEL}")


def kernel_source(version: Version, dest: Path, repo: Path = REPO) -> Path:
    """The working tree when ``version`` is current, else the tag ``fv-kernel-v<version>`` exported into ``dest``."""
    if version == current_kernel_version(repo):
        return repo
    # Tags carry the full release (fv-kernel-v0.1.0); a requirement may say ">=0.1".
    tag = f"fv-kernel-v{version.major}.{version.minor}.{version.micro}"
    proc = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", tag], capture_output=True)
    if proc.returncode != 0:
        raise KernelVersionError(f"cannot export kernel {version} (tag {tag!r}): {proc.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def current_kernel_version(repo: Path = REPO) -> Version:
    return Version(_project(repo / "pyproject.toml")["version"])


def _pip_install(*targets: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *targets], check=True)


def _install_kernel(source: Path) -> None:
    _pip_install(*(["-e", f"{source}[testing]"] if source == REPO else [f"{source}[testing]"]))


def run_against_minimum(
    plugin_dir: Path, also: list[str], command: list[str], repo: Path = REPO, first: list[str] | None = None,
) -> int:
    """The kmin env: the plugin's tests against the oldest kernel it declares, if that is not the current one."""
    version = minimum_kernel_version(plugin_dir)
    if version == current_kernel_version(repo):
        print(f"{plugin_dir.name}: its oldest declared kernel, fv-kernel {version}, is the current kernel; "
              "the kcur env runs these tests against it, so there is nothing older to check")
        return 0
    if not command:
        raise KernelVersionError("--run needs the test command after '--'")
    with tempfile.TemporaryDirectory(prefix="fv-kernel-") as tmp:
        source = kernel_source(version, Path(tmp), repo=repo)
        print(f"fv-kernel {version}: {source}")
        if first:
            _pip_install(*first)
        _install_kernel(source)
        for project in also:
            _pip_install("-e", project)
        _pip_install("-e", f"{plugin_dir}[test]")
    return subprocess.run(command).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plugin_dir", type=Path)
    parser.add_argument("--install", action="store_true", help="pip-install the kernel into this interpreter")
    parser.add_argument("--run", action="store_true", help="the kmin env: install and run the command after '--'")
    parser.add_argument("--also", action="append", default=[], help="with --run: another project to install first")
    parser.add_argument("--first", action="append", default=[],
                        help="with --run: a requirement installed before the kernel (e.g. torch==2.13.0)")
    args, rest = parser.parse_known_args(argv)
    command = rest[1:] if rest[:1] == ["--"] else rest
    try:
        if args.run:
            return run_against_minimum(args.plugin_dir, args.also, command, first=args.first)
        version = minimum_kernel_version(args.plugin_dir)
        with tempfile.TemporaryDirectory(prefix="fv-kernel-") as tmp:
            source = kernel_source(version, Path(tmp))
            print(f"fv-kernel {version}: {source}")
            if args.install:
                _install_kernel(source)
    except KernelVersionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
