"""A non-editable install ships every file of the wan-toy checkpoint.

The README's first command (``pip install ... ./plugins/fv-wan && fv generate --model wan-toy``)
installs fv-wan as a wheel, which holds only what ``[tool.setuptools.package-data]`` names; the
tests here run editable, where the whole folder is there anyway. A file added to the checkpoint
that no pattern names (a tokenizer's vocab.txt, a .bin) would break that command and nothing
else: this test names it.
"""

from __future__ import annotations

import glob
import tomllib
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1]
PACKAGE = PLUGIN / "fv_wan"


def shipped(patterns: list[str]) -> set[str]:
    """Package-relative paths the wheel gets: setuptools expands each pattern with glob."""
    return {str(Path(p).relative_to(PACKAGE)) for pattern in patterns for p in glob.glob(str(PACKAGE / pattern))
            if Path(p).is_file()}


def checkpoint_files() -> set[str]:
    root = PACKAGE / "weights"
    return {str(p.relative_to(PACKAGE)) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")}


def package_data() -> list[str]:
    config = tomllib.loads((PLUGIN / "pyproject.toml").read_text(encoding="utf-8"))
    return list(config["tool"]["setuptools"]["package-data"]["fv_wan"])


def test_the_wheel_ships_every_file_of_the_shipped_checkpoints() -> None:
    files = checkpoint_files()
    assert "weights/wan-toy/fv-card.json" in files and any(f.endswith(".safetensors") for f in files)
    missing = sorted(files - shipped(package_data()))
    assert not missing, f"not in [tool.setuptools.package-data] fv_wan, so not in the wheel: {missing}"
    assert "fv-plugin.yaml" in shipped(package_data())


def test_negative_control_a_pattern_left_out_is_named() -> None:
    patterns = [p for p in package_data() if not p.endswith(".safetensors")]
    missing = checkpoint_files() - shipped(patterns)
    assert missing and all(f.endswith(".safetensors") for f in missing)
