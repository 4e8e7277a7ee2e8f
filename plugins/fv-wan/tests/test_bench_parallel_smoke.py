"""``bench/bench_parallel.py --smoke`` dry-runs on CPU with gloo at 2, 4 and 8 processes (tiny sizes).

The same code paths the GPU run measures (issue 20's 4- and 8-GPU sets included) run end
to end under torchrun; each plan's output must equal the one-process output. Times mean
nothing here. Each launch is bounded by a timeout; on expiry the process group this test
started (torchrun and its workers, in their own session) is killed by its id.

``--baselines --smoke`` (one process, no torchrun) runs the 2-rank cases' 1-GPU side alone:
every case timed, speed-ups null; a failing case (out of memory or other) is recorded in its
row and the others still run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_module import BENCH, load_bench

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


BASELINES = ["dit_1.3b_sp2", "dit_1.3b_cfgp2", "dit_14b_sp2", "vae_decode_vae2"]


def test_the_baselines_run_alone_and_report_no_speedup(tmp_path: Path) -> None:
    out = tmp_path / "baselines.json"
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = run_bounded([sys.executable, str(BENCH), "--baselines", "--smoke", "--out", str(out)], 120, env)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "no parallel time measured (speed-ups null)" in done.stdout
    report = json.loads(out.read_text())
    assert report["mode"] == "baselines" and report["smoke"] and report["world_size"] == 1
    assert report["parallel_measured"] is False and "no parallel time was measured" in report["note"]
    assert report["device"] == "cpu" and report["torch"] == torch.__version__ and report["cuda"] == torch.version.cuda
    assert report["iters"] == 5 and report["warmup"] == 2  # the GPU command's defaults
    assert [row["name"] for row in report["results"]] == BASELINES
    for row in report["results"]:
        assert row["status"] == "measured" and row["error"] is None, row
        assert row["single_s"] > 0, row
        assert row["parallel_s"] is None and row["speedup"] is None, row
        assert row["speedup_ranks"] == 2 and row["measured_on"] == "cpu" and row["peak_gib"] is None  # no peak on CPU
    rows = {row["name"]: row for row in report["results"]}
    # The 1-GPU side of the very plans the 2-rank run times: rows one after another under CFG.
    assert rows["dit_1.3b_sp2"]["plan"] == rows["dit_14b_sp2"]["plan"] == "dp1.cfgp1.ring1.ulysses2.tp1.vae1"
    assert rows["dit_1.3b_cfgp2"]["plan"] == "dp1.cfgp2.ring1.ulysses1.tp1.vae1"
    assert [rows[name]["rows"] for name in BASELINES[:3]] == [1, 2, 1]
    assert rows["dit_14b_sp2"]["tokens"] > rows["dit_1.3b_sp2"]["tokens"]  # the 720p case's longer sequence
    vae = rows["vae_decode_vae2"]
    assert vae["plan"] == "vae2" and vae["pixel_frames"] == (vae["latent"][0] - 1) * 4 + 1
    assert vae["shape"] == f"{vae['pixel_size'][0]}x{vae['pixel_size'][1]}x{vae['pixel_frames']}"


def test_a_failing_baseline_is_recorded_and_the_others_still_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench()
    big_latent = bench._cases(2, True)["dit_14b_sp2"][1]
    built: list[tuple[Any, bool]] = []
    original_step, original_decode = bench._dit_single_step, bench._whole_decode_step

    def dit_step(config: Any, latent: tuple[int, int, int], *, cfg: bool, **kwargs: Any) -> Any:
        if latent == big_latent:  # what a 14B forward that does not fit one GPU raises
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        if not cfg:
            raise ValueError("the 1.3B forward broke")
        built.append((latent, cfg))
        return original_step(config, latent, cfg=cfg, **kwargs)

    decoders: list[Any] = []

    def decode_step(vae: Any, dtype: torch.dtype) -> Any:
        decoders.append(vae)
        return original_decode(vae, dtype)

    monkeypatch.setattr(bench, "_dit_single_step", dit_step)
    monkeypatch.setattr(bench, "_whole_decode_step", decode_step)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "baselines.json"
    with torch.random.fork_rng():
        rc = bench.main(["--baselines", "--smoke", "--iters", "1", "--warmup", "0", "--out", str(out)])
    assert rc == 1  # not every case was measured; the report is written all the same
    rows = {row["name"]: row for row in json.loads(out.read_text())["results"]}
    assert list(rows) == BASELINES
    assert rows["dit_1.3b_sp2"]["status"] == "error"
    assert rows["dit_1.3b_sp2"]["error"] == "ValueError: the 1.3B forward broke"
    assert rows["dit_14b_sp2"]["status"] == "out_of_memory"
    assert rows["dit_14b_sp2"]["error"].endswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 9.00 GiB")
    for name in ("dit_1.3b_sp2", "dit_14b_sp2"):
        assert rows[name]["single_s"] is None and rows[name]["speedup"] is None, rows[name]
        assert rows[name]["tokens"] > 0  # what the case was stays in its row
    # The cases after each failure ran, through the same step and decoder functions the 2-rank run uses.
    for name in ("dit_1.3b_cfgp2", "vae_decode_vae2"):
        assert rows[name]["status"] == "measured" and rows[name]["single_s"] > 0, rows[name]
    assert built == [(bench._cases(2, True)["dit_1.3b_cfgp2"][1], True)] and len(decoders) == 1


def test_baselines_refuse_other_cases_and_torchrun(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    bench = load_bench()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        bench.main(["--baselines", "--smoke", "--only", "dit_1.3b_sp2", "dit_14b_sp4"])
    assert info.value.code == 2
    assert "--baselines measures dit_1.3b_sp2, dit_1.3b_cfgp2, dit_14b_sp2, vae_decode_vae2; --only got dit_14b_sp4" in (
        capsys.readouterr().err)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        bench.main(["--baselines", "--smoke"])
    assert info.value.code == 2 and "launch it with python, not torchrun (got WORLD_SIZE=2)" in capsys.readouterr().err


def test_only_picks_baselines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "baselines.json"
    with torch.random.fork_rng():
        assert bench.main(["--baselines", "--smoke", "--iters", "1", "--warmup", "0", "--only", "dit_1.3b_cfgp2",
                           "--out", str(out)]) == 0
    assert [row["name"] for row in json.loads(out.read_text())["results"]] == ["dit_1.3b_cfgp2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host could measure")
def test_baselines_without_a_gpu_measure_nothing_and_exit_0(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert load_bench().main(["--baselines"]) == 0
    assert json.loads(capsys.readouterr().out) == {"skipped": "nothing measured: --baselines needs one CUDA GPU, found "
                                                              "none (--baselines --smoke runs it on CPU at tiny sizes)"}
