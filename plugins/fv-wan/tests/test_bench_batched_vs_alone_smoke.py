"""``bench/bench_batched_vs_alone.py`` at tiny size on CPU: the batched-vs-alone figures docs/benchmarks.md
records (and the cards declare) come from it, so it must keep running. (``bench/bench_serve_default.py``
starts two real servers; it was run on CPU with wan-tiny before its H200 run, see benchmarks.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def test_batched_vs_alone_measures_fused_and_mixed_step_batches(tmp_path: Path) -> None:
    out = tmp_path / "bva.json"
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_batched_vs_alone.py"), str(out), "--card", "wan-tiny",
                           "--requests", "2", "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["pattern"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["concurrent"]["fused_batches"] > 0 and rows["staggered"]["mixed_step_fused_batches"] > 0
    assert 0 < rows["staggered"]["max_abs"] <= 1e-5  # wan-tiny's declared batched_vs_alone at fp32
