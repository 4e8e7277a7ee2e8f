"""Cosmos 3 through ``fv generate``: the text task writes its answer, the video+audio task's sound
is the MP4's AAC track (or a named .wav beside a .pt / .png), and model text printed to the
terminal has its control characters escaped."""

from __future__ import annotations

import json
import wave
from pathlib import Path
from typing import Any

import av
import pytest
import torch
from typer.testing import CliRunner

from fv_kernel.api import AudioArtifact, Provenance, TaskType, TextArtifact, VideoArtifact
from fv_kernel.cli.app import app
from fv_kernel.cli.generate_cmd import printable, write_result
from fv_kernel.io.media import write_mp4

#: One AAC frame: the most an encoded track's length may differ from the samples it was given.
AAC_FRAME_S = 1024 / 48000


def generate(*args: str) -> Any:
    return CliRunner().invoke(app, ["generate", "--model", "cosmos3-tiny", "--prompt", "a robot arm", "--seed", "3", "-q", *args])


# --------------------------------------------------------------------------- text_generation


def test_text_generation_writes_txt_and_json_and_prints_with_dash(tmp_path: Path) -> None:
    txt, js = tmp_path / "answer.txt", tmp_path / "answer.json"
    first = generate("--task", "text_generation", "--max-tokens", "12", "--output", str(txt))
    assert first.exit_code == 0, first.output
    second = generate("--task", "text_generation", "--max-tokens", "12", "--output", str(js))
    assert second.exit_code == 0, second.output
    record = json.loads(js.read_text(encoding="utf-8"))
    assert set(record) == {"model", "task", "text", "token_ids"}
    assert record["model"] == "cosmos3-tiny" and record["task"] == "text_generation"
    assert 1 <= len(record["token_ids"]) <= 12  # --max-tokens reaches the text task
    assert txt.read_text(encoding="utf-8") == record["text"]  # same seed, same answer, written as generated
    assert f"wrote {txt} ({len(record['text'])} characters, {len(record['token_ids'])} tokens)" in first.output
    printed = generate("--task", "text_generation", "--max-tokens", "12", "--output", "-")
    assert printed.exit_code == 0, printed.output
    # stdout is the answer alone; the random-weights warning goes to stderr
    assert printed.stdout.rstrip("\n") == printable(record["text"])
    assert "random weights" in printed.stderr and "means nothing" in printed.stderr


def test_text_generation_refuses_a_video_suffix_before_any_compute(tmp_path: Path) -> None:
    result = generate("--task", "text_generation", "--output", str(tmp_path / "answer.mp4"))
    assert result.exit_code == 2
    assert "allowed: .txt, .json" in result.output and "Traceback" not in result.output


# --------------------------------------------------------------------------- text_to_video_audio


def audio_track(path: Path) -> tuple[str, int, int, float]:
    """(codec, rate, channels, seconds) of an MP4's one audio stream."""
    with av.open(str(path)) as container:
        assert len(container.streams.audio) == 1 and len(container.streams.video) == 1
        stream = container.streams.audio[0]
        return stream.codec_context.name, stream.rate, stream.channels, float(stream.duration * stream.time_base)


def test_video_audio_sound_is_the_mp4s_audio_track(tmp_path: Path) -> None:
    mp4, pt = tmp_path / "clip.mp4", tmp_path / "clip.pt"
    muxed = generate("--task", "text_to_video_audio", "--output", str(mp4))
    assert muxed.exit_code == 0, muxed.output
    assert not mp4.with_suffix(".wav").exists()  # nothing unnamed beside it
    beside = generate("--task", "text_to_video_audio", "--output", str(pt))
    assert beside.exit_code == 0, beside.output
    sidecar = pt.with_suffix(".wav")
    assert f"wrote {sidecar} (the sound: .pt holds no audio; 150 Hz WAV)" in beside.output
    with wave.open(str(sidecar)) as wav:  # the same seed's sound, as samples
        samples, rate, channels = wav.getnframes(), wav.getframerate(), wav.getnchannels()
    codec, _, track_channels, seconds = audio_track(mp4)
    assert codec == "aac" and track_channels == channels == 2
    assert abs(seconds - samples / rate) <= AAC_FRAME_S
    assert f"sound: AAC track, {samples / rate:.2f} s, 2 channel(s)" in muxed.output


@pytest.mark.parametrize(("rate", "channels", "samples"), [(48000, 1, 18000), (150, 2, 95), (44100, 2, 44100)])
def test_write_mp4_muxes_audio_of_the_given_duration(tmp_path: Path, rate: int, channels: int, samples: int) -> None:
    path = write_mp4(torch.rand(9, 3, 32, 64), 24.0, tmp_path / "a.mp4", audio=torch.rand(channels, samples) * 2 - 1, sample_rate=rate)
    codec, track_rate, track_channels, seconds = audio_track(path)
    assert codec == "aac" and track_channels == channels
    assert track_rate == (rate if rate != 150 else 48000)  # AAC has no 150 Hz: resampled
    assert abs(seconds - samples / rate) <= AAC_FRAME_S


def test_write_mp4_without_audio_has_no_audio_stream(tmp_path: Path) -> None:
    path = write_mp4(torch.rand(3, 3, 32, 64), 24.0, tmp_path / "v.mp4")
    with av.open(str(path)) as container:
        assert len(container.streams.audio) == 0


# --------------------------------------------------------------------------- escaping


def _text(name: str, text: str) -> TextArtifact:
    return TextArtifact(name=name, text=text, token_ids=[1], provenance=Provenance(model_id="cosmos3-tiny", loop_id="test", request_id="r"))


def test_printable_escapes_control_characters() -> None:
    assert printable("\x1b[31mred\x07 bell\nnext\tü 日本") == "\\x1b[31mred\\x07 bell\\nnext\\tü 日本"


def test_upsampled_prompts_are_printed_escaped(tmp_path: Path) -> None:
    video = VideoArtifact(frames=torch.rand(1, 3, 8, 8), fps=8.0, provenance=Provenance(model_id="cosmos3-tiny", loop_id="test", request_id="r"))
    lines = write_result([_text("upsampled_prompt", "\x1b]0;pwned\x07 a fox"), video], tmp_path / "o.png", "cosmos3-tiny",
                         TaskType.TEXT_TO_VIDEO)
    assert lines[0] == "upsampled_prompt: \\x1b]0;pwned\\x07 a fox"
    assert all(ch.isprintable() for line in lines for ch in line)


def test_negative_control_unescaped_text_reaches_the_terminal() -> None:
    """What the escaping is for: the raw rewrite carries ESC and BEL, which a terminal obeys."""
    raw = "\x1b]0;pwned\x07 a fox"
    assert not all(ch.isprintable() for ch in raw)
    assert all(ch.isprintable() for ch in printable(raw))


def test_cli_upsampled_prompt_line_is_printable(tmp_path: Path) -> None:
    result = generate("--upsample-prompt", "--max-tokens", "24", "--output", str(tmp_path / "up.mp4"))
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("upsampled_prompt: "))
    assert all(ch.isprintable() for ch in line)


def test_text_task_answers_printed_with_dash_are_escaped(tmp_path: Path) -> None:
    lines = write_result([_text("text", "ok\x1b[2J\x07")], Path("-"), "cosmos3-tiny", TaskType.TEXT_GENERATION)
    assert lines == ["ok\\x1b[2J\\x07"]
    (tmp_path / "a.txt").write_text("")
    assert write_result([_text("text", "ok\x1b")], tmp_path / "a.txt", "cosmos3-tiny", TaskType.TEXT_GENERATION)
    assert (tmp_path / "a.txt").read_text() == "ok\x1b"  # a file holds the answer as generated
