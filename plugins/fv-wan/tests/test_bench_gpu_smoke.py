"""``bench/bench_gpu.py``: its Engine sections at tiny size on CPU, and the real-size card it builds.

On the H200 (2026-12-01) every Engine section failed preflight: the real fastwan card names a hub
checkpoint, which the bench never loads (it builds random weights). The card it hands the Engine
now says so, and preflight asks for nothing.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.preflight import check_checkpoint_source

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def test_the_real_size_engine_card_needs_no_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bench_gpu = importlib.import_module("bench_gpu")
    card = bench_gpu.engine_card(SimpleNamespace(smoke=False))
    assert card.model_id == "fastwan2.1-t2v-1.3b"
    assert check_checkpoint_source(card, InstanceOptions(device="cpu"), list(card.checkpoint.components)) is None


def test_engine_sections_and_step_parts_run_at_tiny_size(tmp_path: Path) -> None:
    skip = ["matmul", "diffusers", "graphs", "vae", "step_batching", "compiled"]
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_gpu.py"), str(tmp_path), "--smoke", "--skip", *skip],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    sections = json.loads((tmp_path / "results.json").read_text())["sections"]
    throughput, e2e = sections["engine_throughput"], sections["e2e"]
    for key, run in [*throughput.items(), ("e2e", e2e)]:
        if isinstance(run, dict):
            assert run["failed"] == [], (key, run["failed"])
            assert set(run["op_device_ms"]) == {"encode_text", "dit_forward:transformer", "vae_decode_frame"}
    assert throughput["4:batched"]["batches_by_size"] == {"4": 5}  # text, 3 DiT steps, decode: each fused across the 4
    assert e2e["attention"] == "dense (vsa needs CUDA)"
    # One step split into attention, matmul and the rest, for fv and for diffusers (CPU: aten ops' self time).
    parts = sections["step_parts"]
    for impl in ("fv eager", "fv fused[torch]", "diffusers eager"):
        row = parts[impl]
        assert row["attention_ms"] > 0 and row["matmul_ms"] > 0
        assert abs(row["attention_ms"] + row["matmul_ms"] + row["other_ms"] - row["busy_ms"]) < 0.05
        assert {t["part"] for t in row["top"]} <= {"attention", "matmul", "other"}


def test_profile_engine_writes_where_the_host_time_goes(tmp_path: Path) -> None:
    # bench/profile_engine.py found the decode loop's 223 ms pageable copy on the H200 (docs/benchmarks.md).
    done = subprocess.run([sys.executable, str(BENCH_DIR / "profile_engine.py"), str(tmp_path), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for case in ("single8", "e2e"):
        report = (tmp_path / f"{case}.txt").read_text()
        assert "'failed': []" in report and "loop_host_s" in report
        assert "_schedule_forever" in report and "advance" in report  # the Engine's loop and the loops' host code


def test_bench_first_request_reports_the_engines_time_per_request() -> None:
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_first_request.py"), "--requests", "2", "--steps", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["0", "1"] and all(row.endswith("% |") for row in rows)


def test_bench_first_request_cold_start_reports_generate_and_serve() -> None:
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_first_request.py"), "--cold-start", "--runs", "1",
                           "--cold-steps", "1", "--top", "3"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| fv ")}
    assert set(rows) == {"fv generate --model wan-toy", "fv serve --model wan-toy, until /health answers"}, done.stdout
    figures = [float(cell) for cell in rows["fv generate --model wan-toy"].split("|")[2:6]]
    wall, to_loaded, imports, load = figures
    assert 0 < load < to_loaded < wall and 0 < imports < wall
    assert "| torch |" in done.stdout  # the import breakdown by package names torch


def test_bench_first_request_cold_start_generate_only_leaves_serve_out() -> None:
    done = subprocess.run([sys.executable, str(BENCH_DIR / "bench_first_request.py"), "--cold-start", "--runs", "1",
                           "--cold-steps", "1", "--top", "3", "--generate-only"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| fv ")}
    assert "not measured (--generate-only)" in rows["fv serve --model wan-toy, until /health answers"]
    assert float(rows["fv generate --model wan-toy"].split("|")[2]) > 0
    assert "fv serve: top" not in done.stdout
