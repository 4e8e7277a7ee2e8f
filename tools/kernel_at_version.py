#!/usr/bin/env python3
"""Install (or locate) fv-kernel at the oldest version a plugin declares.

    python tools/kernel_at_version.py plugins/fv-wan            # print the kernel source dir
    python tools/kernel_at_version.py --install plugins/fv-wan  # and pip-install it

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
    current = Version(_project(repo / "pyproject.toml")["version"])
    if version == current:
        return repo
    tag = f"fv-kernel-v{version}"
    proc = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", tag], capture_output=True)
    if proc.returncode != 0:
        raise KernelVersionError(f"cannot export kernel {version} (tag {tag!r}): {proc.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plugin_dir", type=Path)
    parser.add_argument("--install", action="store_true", help="pip-install the kernel into this interpreter")
    args = parser.parse_args(argv)
    try:
        version = minimum_kernel_version(args.plugin_dir)
        with tempfile.TemporaryDirectory(prefix="fv-kernel-") as tmp:
            source = kernel_source(version, Path(tmp))
            print(f"fv-kernel {version}: {source}")
            if args.install:
                cmd = [sys.executable, "-m", "pip", "install", "-q"]
                cmd += ["-e", f"{source}[testing]"] if source == REPO else [f"{source}[testing]"]
                subprocess.run(cmd, check=True)
    except KernelVersionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
