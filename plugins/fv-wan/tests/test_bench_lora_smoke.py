"""``bench/bench_lora.py`` at tiny size on CPU: the per-row LoRA figures docs/benchmarks.md records come
from it, so it must keep running, and its per-row outputs must equal each request run alone and merged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def test_bench_lora_times_every_case_and_checks_its_rows(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_lora.py"), str(tmp_path), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["errors"] == {}
    cases = results["cases"]
    assert set(cases) == {"a.base", "a.per_row", "a.per_row_kept", "a.one_at_a_time", "a.adapter_per_batch",
                          "b.base", "b.per_row", "c.base", "c.merged", "diffusers.base", "a.profile"}
    assert cases.pop("a.profile") == {"skipped": "the kernel breakdown needs CUDA"}
    assert all(row["ms"] > 0 for row in cases.values())
    a, b, c = cases["a.per_row"], cases["b.per_row"], cases["c.merged"]
    assert a["max_abs_lora_effect"] > 1e-3  # the LoRAs move the output, so the equalities below mean something
    assert a["max_abs_vs_alone"] < 1e-4 and a["max_abs_vs_merged"] < 1e-4  # fp32
    assert b["max_abs_vs_alone"] < 1e-4 and c["max_abs_vs_per_row"] < 1e-4
    assert cases["diffusers.base"]["max_abs_vs_fv"] < 1e-4  # the reference model runs the same weights
    table = (tmp_path / "table.md").read_text()
    assert "| a.per_row | 3 | 64x64x1 |" in table and ">= 0.85x" in table and "within 2%" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA exit is for machines without CUDA")
def test_bench_lora_without_cuda_says_why_and_exits_cleanly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_lora.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "needs CUDA" in done.stdout
    assert "needs CUDA" in json.loads((tmp_path / "results.json").read_text())["skipped"]
