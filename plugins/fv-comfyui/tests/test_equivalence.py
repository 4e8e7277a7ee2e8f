"""The three fixture workflows, retargeted to fv-wan's tiny cards, give bit-identical frames to the
equivalent ``fv generate`` command (run as its own process) on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from conftest import load_pair, retarget
from fv_comfyui.convert import ui_to_api
from fv_comfyui.run import JobRunner


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and both sides must use the same count.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _fv_generate(args: list[str], output: Path) -> torch.Tensor:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    script = "import torch, sys; torch.set_num_threads(1); from fv_kernel.cli.app import main; sys.argv = ['fv', *sys.argv[1:]]; main()"
    done = subprocess.run(
        [sys.executable, "-c", script, "generate", *args, "--output", str(output), "--quiet"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert done.returncode == 0, done.stderr
    return torch.load(output)


@pytest.mark.parametrize("name", ["text_to_video_wan", "image_to_video_wan_example", "text_to_video_wan22_14B"])
def test_fixture_workflow_equals_fv_generate(name: str, service: Any, tmp_path: Path) -> None:
    ui, _ = load_pair(name)
    # From the UI workflow, as a user's saved file would come.
    answer = service.check(retarget(ui_to_api(ui), steps=3))
    assert answer.ok, answer.body()
    (job,) = answer.jobs
    image = service.image_path(job.image_name) if job.image_name else None
    runner = JobRunner()
    video = runner.run(job, image)
    assert video.frames.shape[0] == 5 and video.frames.shape[-2:] == (32, 32)

    model = job.card.model_id
    expected = _fv_generate(job.fv_generate_args(model, str(image) if image else None), tmp_path / "out.pt")
    assert torch.equal(video.frames, expected), (video.frames - expected).abs().max()


def test_negative_control_another_seed_differs(service: Any) -> None:
    prompt = retarget(load_pair("text_to_video_wan")[1], steps=2)
    (job,) = service.check(prompt).jobs
    runner = JobRunner()
    first = runner.run(job).frames
    job.options["seed"] += 1
    assert not torch.equal(first, runner.run(job).frames)
