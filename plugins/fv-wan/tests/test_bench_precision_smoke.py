"""``bench/bench_precision.py`` at tiny size on CPU: the precision-path figures docs/benchmarks.md will
record come from it, so it must keep running every path beside diffusers and keep its checks honest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"
PATHS = ("native", "fp8_weights", "fp8_dynamic", "fp8_dynamic_unfused_quantization", "fp8_attention", "fp8_all")


def test_bench_precision_runs_every_path_beside_diffusers(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_precision.py"), str(tmp_path), "--smoke"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["errors"] == {}
    case = results["models"]["tiny (smoke)"]
    assert "diffusers_error" not in case
    rows = case["rows"]
    assert set(rows) == {"diffusers bf16", *PATHS}
    assert all(row["ms"] > 0 and row["ratio_vs_diffusers"] > 0 for path, row in rows.items() if path in PATHS)
    # The same random weights in both models: fv native equals diffusers (fp32 on CPU).
    assert case["rel_err_native_vs_diffusers"] < 1e-4
    # Every fp8 path is quantized (it moves the output) but close to native.
    for path in PATHS[1:]:
        assert 1e-4 < rows[path]["rel_err_vs_native"] < 0.1, (path, rows[path])
    # An e4m3 target holds 1 byte a weight (fp32 on CPU: 4): fewer bytes than native; attention changes no weight.
    assert case["fp8_targets"] == 2 * 10  # q/k/v/o of attn1 and attn2 and the two FFN linears, two blocks
    assert rows["fp8_weights"]["weight_bytes"] < rows["native"]["weight_bytes"]
    assert rows["fp8_all"]["weight_bytes"] == rows["fp8_dynamic"]["weight_bytes"] == rows["fp8_weights"]["weight_bytes"]
    assert rows["fp8_attention"]["weight_bytes"] == rows["native"]["weight_bytes"]
    table = (tmp_path / "table.md").read_text()
    assert all(f"| tiny (smoke) | {path} |" in table for path in PATHS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA exit is for machines without CUDA")
def test_bench_precision_without_cuda_says_why_and_exits_cleanly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_precision.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "needs CUDA" in done.stdout
    assert "needs CUDA" in json.loads((tmp_path / "results.json").read_text())["skipped"]
