"""``bench/bench_parallel.py --smoke`` dry-runs on CPU with gloo at 2, 4 and 8 processes (tiny sizes).

The same code paths the GPU run measures (issue 20's 4- and 8-GPU sets included) run end
to end under torchrun; each plan's output must equal the one-process output. Times mean
nothing here. Each launch is bounded by a timeout; on expiry the process group this test
started (torchrun and its workers, in their own session) is killed by its id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[3] / "bench" / "bench_parallel.py"
TIMEOUT_S = {2: 120, 4: 180, 8: 300}
EXPECTED = {
    2: {"dit_1.3b_sp2", "dit_1.3b_cfgp2", "dit_14b_sp2", "vae_decode_vae2"},
    4: {"dit_14b_sp4", "dit_1.3b_sp4"},
    8: {"dit_14b_sp8", "dit_14b_sp4_cfgp2", "dit_14b_sp4", "dit_1.3b_sp4", "vae_decode_vae8", "e2e_14b_720p"},
}


def run_bounded(command: list[str], timeout_s: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the session this test started: torchrun and its ranks
        out, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} ran past {timeout_s} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, None)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_bench_dry_runs_on_gloo(ranks: int, tmp_path: Path) -> None:
    out = tmp_path / "parallel.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.pop(name, None)  # the script sets them itself
    done = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                        str(BENCH), "--smoke", "--iters", "1", "--warmup", "0", "--e2e-steps", "3", "--out", str(out)],
                       TIMEOUT_S[ranks], env)
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] and report["world_size"] == ranks
    assert report["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    rows = {row["name"]: row for row in report["results"]}
    assert set(rows) == EXPECTED[ranks]
    for name, row in rows.items():
        assert row["max_abs_diff_vs_single"] < 1e-5, (name, row)
        assert row["single_s"] > 0 and row["parallel_s"] > 0, name
    if "dit_1.3b_sp4" in rows:  # the Ulysses exchanges were seen and timed
        row = rows["dit_1.3b_sp4"]
        assert row["all_to_all_calls"] > 0 and 0 < row["all_to_all_share"] < 1
        assert row["ranks"] == 4 and row["plan"].startswith(f"dp{ranks // 4}.")
    if ranks == 8:
        assert rows["e2e_14b_720p"]["plan"] == "dp1.cfgp2.ring2.ulysses2.tp1.vae1" and rows["e2e_14b_720p"]["steps"] == 3
        assert rows["dit_14b_sp8"]["plan"] == "dp1.cfgp1.ring1.ulysses8.tp1.vae1"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 8, reason="this host could measure")
def test_without_enough_gpus_nothing_is_measured_and_it_exits_0() -> None:
    env = {**os.environ, "WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0"}
    done = run_bounded([sys.executable, str(BENCH)], 120, env)
    assert done.returncode == 0, done.stdout
    assert "nothing measured" in done.stdout and "8 ranks need 8 CUDA GPUs" in done.stdout
    bare = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK")}
    done = run_bounded([sys.executable, str(BENCH)], 120, bare)
    assert done.returncode == 0 and "nothing measured" in done.stdout
