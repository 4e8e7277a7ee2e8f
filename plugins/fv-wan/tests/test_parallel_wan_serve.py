"""``fv serve --config`` with a ``parallel:`` section (sp=2 on wan-tiny): launched by fv's own
spawn and by torchrun, a job's video equals the single-process run within 1e-5, and the
worker rank exits when the server stops."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart, build_instance, run_local  # noqa: E402
from fv_kernel.testing import free_port, wait_for_job  # noqa: E402
from fv_serve_process import KEEP_FRAMES_FV, serving_process  # noqa: E402


JOB = {"model": "wan-tiny", "prompt": "a paper boat on a river", "seed": 7, "steps": 4, "frames": 5, "size": "32x32"}


@contextlib.contextmanager
def served(data_dir: Path, launcher: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client]]:
    config = data_dir / "deploy.yaml"
    config.write_text(f"cards: [wan-tiny]\noutput_dir: {data_dir / 'out'}\nparallel:\n  sp: 2\n")
    script = data_dir / "fv_main.py"
    script.write_text(KEEP_FRAMES_FV)
    port = free_port()
    command = [*launcher, str(script), "serve", "--config", str(config), "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    process: subprocess.Popen[bytes] | None = None
    try:
        # a loaded CI machine starts two ranks slowly
        with serving_process(command, env, port, healthy_timeout_s=400) as (process, client):
            yield process, client
    finally:
        # No rank outlives the server (multiprocessing's resource tracker takes a moment to follow it).
        deadline = time.monotonic() + 20
        while process is not None and (
            leftover := subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout.split()
        ):
            if time.monotonic() > deadline:
                os.killpg(process.pid, signal.SIGKILL)
                raise AssertionError(f"processes of the pool still running: {leftover}")
            time.sleep(0.2)


def _single_process_frames(wan_card: Any) -> torch.Tensor:
    request = Request(model="wan-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=JOB["prompt"]),),
                      diffusion=DiffusionParams(seed=JOB["seed"], steps=JOB["steps"], frames=JOB["frames"], height=32, width=32))
    return next(a for a in run_local(request, build_instance(wan_card("wan-tiny"))) if a.kind == "video").frames


LAUNCHERS = {
    "fv-spawn": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_fv_serve_with_a_parallel_plan(tmp_path: Path, wan_card: Any, launcher: str) -> None:
    command = LAUNCHERS[launcher] + ([str(free_port())] if launcher == "torchrun" else [])
    with served(tmp_path, command) as (_, client):
        job = client.post("/v1/videos", json=JOB).json()
        assert wait_for_job(client, job["id"], {"completed", "failed"}, timeout_s=400)["status"] == "completed"
    frames = torch.load(tmp_path / "out" / job["id"] / "frames.pt", weights_only=True)
    reference = _single_process_frames(wan_card)
    assert frames.shape == reference.shape
    assert float((frames - reference).abs().max()) <= 1e-5


def test_fv_serve_restarts_a_killed_rank_and_the_job_resumes(tmp_path: Path, wan_card: Any) -> None:
    # fv's own spawn can restart the ranks it started: the worker is killed mid-denoise, rank 0
    # restarts the pool and runs the failed step again; the job completes as if nothing happened.
    job_spec = {**JOB, "steps": 40}
    with served(tmp_path, LAUNCHERS["fv-spawn"]) as (process, client):
        job = client.post("/v1/videos", json=job_spec).json()
        deadline = time.monotonic() + 400
        while client.get(f"/v1/videos/{job['id']}").json()["progress"] < 30:
            assert time.monotonic() < deadline, "the job never got going"
            time.sleep(0.05)
        workers = _worker_pids(process.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        done = wait_for_job(client, job["id"], {"completed", "failed"}, timeout_s=400)
        assert done["status"] == "completed", done
        replacement = _worker_pids(process.pid)
        assert len(replacement) == 1 and replacement != workers, (workers, replacement)
    frames = torch.load(tmp_path / "out" / job["id"] / "frames.pt", weights_only=True)
    request = Request(model="wan-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=JOB["prompt"]),),
                      diffusion=DiffusionParams(seed=JOB["seed"], steps=40, frames=JOB["frames"], height=32, width=32))
    reference = next(a for a in run_local(request, build_instance(wan_card("wan-tiny"))) if a.kind == "video").frames
    assert float((frames - reference).abs().max()) <= 1e-5


def _worker_pids(server_pid: int) -> list[int]:
    """The pool's worker ranks: the server's children that fv's spawn started (``spawn_main``)."""
    found = subprocess.run(["pgrep", "-P", str(server_pid), "-f", "spawn_main"], capture_output=True, text=True)
    return sorted(int(pid) for pid in found.stdout.split())
