"""Running the docs' shell examples as they are written.

A ```bash block right after an ``<!-- doc-test: ... -->`` line is run with bash in a given
directory (with this interpreter's ``bin`` first on PATH, so ``fv`` and ``python`` are this
environment's); each of its ``# `` lines is output the run must print.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "doc_blocks", "run_doc_block"]

REPO = Path(__file__).resolve().parents[3]


def doc_blocks(doc: Path, marker: str) -> list[str]:
    """The bash blocks of ``doc`` announced by a doc-test comment that mentions ``marker``."""
    pattern = r"<!-- doc-test:[^>]*" + re.escape(marker) + r"[^>]*-->\n```bash\n(.*?)```"
    return re.findall(pattern, doc.read_text(encoding="utf-8"), flags=re.S)


def run_doc_block(block: str, cwd: Path) -> str:
    """Run ``block``; assert every ``# `` line appears in its output (stdout and stderr); return the output."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", block], cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    output = done.stdout + done.stderr
    for line in block.splitlines():
        if line.startswith("# "):
            expected = line[2:].strip()
            assert expected in output, f"expected {expected!r} in the output of\n{block}\n--- output ---\n{output}"
    return output
