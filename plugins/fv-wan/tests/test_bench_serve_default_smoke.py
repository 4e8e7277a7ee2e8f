"""``bench/bench_batched_vs_alone.py`` and ``bench/bench_serve_default.py`` at tiny size on CPU: the figures
docs/benchmarks.md records for the H200 come from these scripts, so they must keep running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def test_batched_vs_alone_measures_fused_and_mixed_step_batches(tmp_path: Path) -> None:
    out = tmp_path / "bva.json"
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_batched_vs_alone.py"), str(out), "--card", "wan-tiny",
                           "--requests", "3", "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["pattern"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["concurrent"]["fused_batches"] > 0 and rows["staggered"]["mixed_step_fused_batches"] > 0
    assert 0 < rows["staggered"]["max_abs"] <= 1e-5  # wan-tiny's declared batched_vs_alone at fp32


def test_serve_default_runs_fv_serve_and_reads_its_fused_calls(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_serve_default.py"), str(out), "--card", "wan-tiny", "--device", "cpu",
         "--size", "96x64", "--steps", "2", "--images", "4", "--clients", "4", "--skip", "mixed"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    default = json.loads(out.read_text())["default"]
    assert default["one_at_a_time_rps"] > 0 and default["concurrent_rps"] > 0
    assert default["metrics"]["fv_fused_calls"], "the default config fused nothing for concurrent clients"
