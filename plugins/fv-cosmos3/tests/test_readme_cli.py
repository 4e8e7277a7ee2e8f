"""The README's "Use it" lines that name a Cosmos 3 card run as written.

fv-wan's tests run the README's other lines (``plugins/fv-wan/tests/test_readme_cli.py``);
fv-wan is not installed with fv-cosmos3 there, so the Cosmos 3 lines run here, where both are.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def cosmos3_lines() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Use it\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert section, "README.md has no '## Use it' section"
    block = re.search(r"```\n(.*?)```", section.group(1), flags=re.S)
    assert block, "the 'Use it' section has no code block"
    commands = [line.partition("  #")[0].strip() for line in block.group(1).splitlines()]
    return [c for c in commands if "cosmos3" in c]


def test_the_readme_cosmos3_lines_run_as_written(tmp_path: Path) -> None:
    lines = cosmos3_lines()
    assert lines, "the README's 'Use it' block names no Cosmos 3 card"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for command in lines:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"README line failed: {command}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, done.stderr
        for output in re.findall(r"--output (\S+)", command):
            assert (tmp_path / output).is_file() and (tmp_path / output).stat().st_size > 0, (command, output)
