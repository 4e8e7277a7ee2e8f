"""``fv serve --config`` with wan-tiny, killed with SIGKILL mid-denoise and restarted on the same data
dir: the job resumes from its last checkpoint and its video is bit-identical to an uninterrupted run.

The servers run the real ``fv serve`` command in a subprocess; the only test hook keeps the final
frames tensor next to the MP4 (``frames.pt``), so the comparison is bit-exact rather than through
a lossy encode. A job whose card is no longer served after the restart fails with the reason.
"""

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
pytest.importorskip("av")
httpx = pytest.importorskip("httpx")

from fv_kernel.api import ProgramCheckpoint, build_instance, run_local  # noqa: E402
from fv_kernel.testing import free_port, job_progress, wait_for_job  # noqa: E402
from fv_serve_process import KEEP_FRAMES_FV, serving_process  # noqa: E402


JOB = {"model": "wan-tiny", "prompt": "a paper boat on a river", "seed": 42, "steps": 8, "frames": 5}


@contextlib.contextmanager
def fv_serve(data_dir: Path, *cards: str, every: int = 1) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client]]:
    config = data_dir / "deploy.yaml"
    config.write_text(
        f"cards: [{', '.join(cards)}]\noutput_dir: {data_dir / 'out'}\nserver:\n  checkpoint_every_steps: {every}\n"
    )
    port = free_port()
    command = [sys.executable, "-c", KEEP_FRAMES_FV, "serve", "--config", str(config), "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "FV_TEST_THREADS": str(torch.get_num_threads())}
    with serving_process(command, env, port, healthy_timeout_s=300) as (process, client):
        yield process, client


def test_fv_serve_killed_mid_denoise_resumes_bit_identically_after_restart(tmp_path: Path, wan_card: Any) -> None:
    checkpoints = tmp_path / "out" / "checkpoints"
    with fv_serve(tmp_path, "wan-tiny") as (process, client):
        job = client.post("/v1/videos", json=JOB).json()
        path = checkpoints / f"{job['id']}.pt"
        deadline = time.monotonic() + 600
        while True:  # until the checkpoint shows the denoise loop past its second step
            with contextlib.suppress(Exception):
                seen = ProgramCheckpoint.load(path)
                if any(r.loop_id == "denoise" and r.step >= 2 for r in seen.running):
                    break
            assert time.monotonic() < deadline, "the job never checkpointed mid-denoise"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    left = ProgramCheckpoint.load(path)
    (denoise,) = [r for r in left.running if r.loop_id == "denoise"]
    assert 2 <= denoise.step < 8, f"killed mid-denoise, not at {left.position()}"
    assert not (tmp_path / "out" / job["id"] / "video.mp4").exists()

    with fv_serve(tmp_path, "wan-tiny") as (_, client):
        assert wait_for_job(client, job["id"], {"completed", "failed"})["status"] == "completed"
        # It continued from the checkpoint: the first step this server ran is the next denoise step.
        ran = job_progress(client, job["id"])
        assert ran[0] == ("denoise", denoise.step + 1) and ("text_encode", 1) not in ran, ran[:3]
        resumed_mp4 = client.get(f"/v1/videos/{job['id']}/content").content
        again = client.post("/v1/videos", json=JOB).json()  # the same request, never interrupted
        assert wait_for_job(client, again["id"], {"completed", "failed"})["status"] == "completed"
        assert client.get(f"/v1/videos/{again['id']}/content").content == resumed_mp4
    resumed = torch.load(tmp_path / "out" / job["id"] / "frames.pt", weights_only=True)
    uninterrupted = torch.load(tmp_path / "out" / again["id"] / "frames.pt", weights_only=True)
    assert torch.equal(resumed, uninterrupted)
    # And the same request run in this process, start to finish.
    instance = build_instance(wan_card("wan-tiny"))
    direct = next(a for a in run_local(left.request, instance) if a.kind == "video").frames
    assert torch.equal(resumed, direct)
    assert not path.exists(), "a finished job's checkpoint is deleted"


def test_a_job_whose_card_is_no_longer_served_fails_with_the_reason(tmp_path: Path) -> None:
    with fv_serve(tmp_path, "wan-tiny") as (process, client):
        job = client.post("/v1/videos", json={**JOB, "steps": 50}).json()
        wait_for_job(client, job["id"], {"in_progress"})
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    with fv_serve(tmp_path, "fastwan-tiny") as (_, client):
        failed = client.get(f"/v1/videos/{job['id']}").json()
    assert failed["status"] == "failed" and failed["error"]["type"] == "not_resumable", failed
    assert "card 'wan-tiny' is no longer served (served: fastwan-tiny)" in failed["error"]["message"]
    assert not (tmp_path / "out" / "checkpoints" / f"{job['id']}.pt").exists()
