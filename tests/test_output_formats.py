"""One list of video output formats: ``fv generate --output`` and ``Video.save`` accept the same
suffixes (``fv_kernel.io.media.VIDEO_OUTPUT_SUFFIXES``), and each one the CLI writes reads back,
with Pillow / PyAV / torch directly, as the video that was generated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fv_kernel.cli.generate_cmd as generate_cmd
from fv_kernel import facade
from fv_kernel.cli.app import app
from fv_kernel.io.media import VIDEO_OUTPUT_SUFFIXES, MediaError, check_output_path
from fv_kernel.testing.toy import toy_card

av = pytest.importorskip("av")
Image = pytest.importorskip("PIL.Image")


def _card_file(tmp_path: Path) -> str:
    path = tmp_path / "card.json"
    path.write_text(toy_card("toy-dit").model_dump_json())
    return str(path)


def _generate(tmp_path: Path, output: Path) -> None:
    result = CliRunner().invoke(
        app, ["generate", "--model", _card_file(tmp_path), "--prompt", "a red fox", "--seed", "3", "-q", "--output", str(output)],
    )
    assert result.exit_code == 0, result.output


def _read_back(path: Path) -> tuple[int, int, int]:
    """(frames, width, height) of a written file, read without fv's own code."""
    suffix = path.suffix
    if suffix == ".pt":
        frames = torch.load(path)
        return frames.shape[0], frames.shape[3], frames.shape[2]
    if suffix == ".mp4":
        with av.open(str(path)) as container:
            decoded = [f for f in container.decode(video=0)]
        return len(decoded), decoded[0].width, decoded[0].height
    with Image.open(path) as img:
        return getattr(img, "n_frames", 1), img.width, img.height


def test_the_cli_and_the_facade_read_one_list() -> None:
    assert generate_cmd._OUTPUT_SUFFIXES == VIDEO_OUTPUT_SUFFIXES == facade.SAVE_SUFFIXES
    assert set(VIDEO_OUTPUT_SUFFIXES) >= {".mp4", ".gif", ".png", ".pt"}
    help_text = CliRunner().invoke(app, ["generate", "--help"], terminal_width=400).output
    for suffix in VIDEO_OUTPUT_SUFFIXES:
        assert suffix in help_text


@pytest.mark.parametrize("suffix", VIDEO_OUTPUT_SUFFIXES)
def test_each_listed_format_round_trips_through_the_cli(tmp_path: Path, suffix: str) -> None:
    reference = tmp_path / "reference.pt"
    _generate(tmp_path, reference)
    frames, width, height = _read_back(reference)
    out = tmp_path / f"video{suffix}"
    _generate(tmp_path, out)
    expected_frames = 1 if suffix == ".png" else frames  # .png: the first frame
    assert _read_back(out) == (expected_frames, width, height)


def test_an_unlisted_suffix_is_refused_naming_the_list(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--model", "anything", "--prompt", "x", "--output", str(tmp_path / "x.webm")])
    assert result.exit_code == 2 and "output: unsupported suffix '.webm'" in result.output
    assert "allowed: " + ", ".join(VIDEO_OUTPUT_SUFFIXES) in result.output
    with pytest.raises(MediaError, match="path: unsupported suffix '.webm'"):
        check_output_path(tmp_path / "x.webm", facade.SAVE_SUFFIXES, param="path")
