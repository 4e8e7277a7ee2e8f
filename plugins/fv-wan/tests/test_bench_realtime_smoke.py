"""``bench/bench_realtime.py --smoke`` still runs and measures what it says: wan-toy-causal sessions on CPU at
64x64 through ``Engine.open_session``, one session's FPS / first-chunk latency / faster-than-real-time verdict,
and two concurrent sessions with batching on (their forwards fused: batches of 2 rows) and off (every forward
alone). The H200 figures are in docs/benchmarks.md; without CUDA and without ``--smoke`` it exits 0 saying so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fv_wan.toy_card import wan_toy_causal_card

BENCH = Path(__file__).resolve().parents[3] / "bench" / "bench_realtime.py"
TIMEOUT_S = 300


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    process = subprocess.Popen([sys.executable, str(BENCH), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the bench ran past {TIMEOUT_S} s:\n{output[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, output)


@pytest.mark.skipif(wan_toy_causal_card() is None, reason="wan-toy-causal's weights are not installed")
def test_smoke_streams_two_sessions_batched_and_not(tmp_path: Path) -> None:
    out = tmp_path / "rt.json"
    done = _run(str(out), "--smoke", "--seconds", "1.5", "--sessions", "2")
    assert done.returncode == 0, done.stdout[-3000:]
    result = json.loads(out.read_text())
    one = result["one_session"]
    assert result["card"] == "wan-toy-causal" and result["size"] == [64, 64] and result["device"] == "cpu"
    assert one["chunks"] >= 1 and one["fps"] > 0 and one["first_chunk_latency_s"] > 0
    assert result["faster_than_realtime"] == (one["fps"] >= 8.0)  # the card plays at 8 FPS
    assert one["steps"]["dit_seconds_per_chunk"] > 0 and one["steps"]["vae_seconds_per_chunk"] > 0
    two = result["concurrent"]["2"]
    assert all(r["chunks"] >= 1 for r in two["batching_on"]["sessions"] + two["batching_off"]["sessions"])
    # Batching on fused the two sessions' forwards; off, every forward ran alone.
    assert "2" in two["batching_on"]["steps"]["forward_batch_sizes"]
    assert set(two["batching_off"]["steps"]["forward_batch_sizes"]) == {"1"}
    assert "than real time" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_it_exits_cleanly_with_a_message(tmp_path: Path) -> None:
    done = _run(str(tmp_path / "rt.json"), "--seconds", "1")
    assert done.returncode == 0 and "skipped" in done.stdout and "CUDA" in done.stdout
    assert "Traceback" not in done.stdout and not (tmp_path / "rt.json").exists()
