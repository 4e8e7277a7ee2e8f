"""The Python façade on cosmos3-tiny: text-to-video-with-audio comes back with its sound track,
the same frames ``fv generate`` writes, and an MP4 that carries the sound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fv_kernel as fv
from fv_kernel.api import InvalidRequest
from fv_kernel.cli.app import app


def test_video_with_audio_through_the_facade_matches_fv_generate(tmp_path: Path) -> None:
    av = pytest.importorskip("av")
    gen = fv.load("cosmos3-tiny")
    video = gen.generate("a fox", task="text_to_video_audio", seed=3)
    assert video.audio is not None and video.audio.samples.shape[0] in (1, 2)
    out = tmp_path / "cli.pt"
    result = CliRunner().invoke(app, ["generate", "--quiet", "--model", "cosmos3-tiny", "--task", "text_to_video_audio",
                                      "--prompt", "a fox", "--seed", "3", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert torch.equal(torch.load(out), video.frames)
    with av.open(str(video.save(tmp_path / "fox.mp4"))) as container:
        assert {s.type for s in container.streams} == {"video", "audio"}
    with pytest.raises(InvalidRequest, match="task 'text_generation' of 'cosmos3-tiny' makes no video; allowed: "):
        gen.generate("a fox", task="text_generation")
