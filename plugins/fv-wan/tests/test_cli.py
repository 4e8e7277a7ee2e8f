"""``fv generate`` / ``fv cards list`` on fv-wan's cards, in process through typer's CliRunner.

Bad input is one ``error:`` line naming the field and the allowed values, exit code 2,
and no file written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from fv_kernel.cli.app import app

PROMPT = "a red fox"


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _error_line(result: Any) -> str:
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_generate_wan_tiny_writes_a_playable_mp4(tmp_path: Path) -> None:
    out = tmp_path / "out.mp4"
    result = _invoke("generate", "--model", "wan-tiny", "--prompt", PROMPT, "--output", str(out))
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "9 frames, 96x64, 8 fps" in result.output
    # The denoise progress bar ran to the card's default step count.
    assert "denoise" in result.output and "8/8" in result.output
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert (stream.width, stream.height) == (96, 64)
        assert stream.average_rate == 8
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    assert len(frames) == 9
    assert all(f.shape == (64, 96, 3) for f in frames) and np.std(frames) > 5  # real content, not a blank clip


def test_generate_png_and_tensor_outputs_agree(tmp_path: Path) -> None:
    png, tensor = tmp_path / "first.png", tmp_path / "video.pt"
    for out in (png, tensor):
        result = _invoke("generate", "--model", "wan-tiny", "--prompt", PROMPT, "--seed", "3", "--quiet",
                         "--frames", "5", "--height", "32", "--width", "48", "--steps", "2", "--output", str(out))
        assert result.exit_code == 0, result.output
    video = torch.load(tensor)
    assert video.dtype == torch.float32 and video.shape == (5, 3, 32, 48)
    first = np.asarray(Image.open(png).convert("RGB"))
    expected = (video[0].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.array_equal(first, expected)


def test_text_to_video_loads_no_vae_encoder_and_no_image_encoder(tmp_path: Path, monkeypatch) -> None:
    import fv_kernel.cli.generate_cmd as generate_cmd

    built: list[Any] = []
    original = generate_cmd.build_instance

    def recording_build(*args: Any, **kwargs: Any) -> Any:
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(generate_cmd, "build_instance", recording_build)
    # wan-tiny-ti2v declares a VAE encoder (for its image-to-video task): text-to-video must not load it.
    result = _invoke("generate", "--model", "wan-tiny-ti2v", "--prompt", PROMPT, "--quiet", "--steps", "2",
                     "--output", str(tmp_path / "t2v.pt"))
    assert result.exit_code == 0, result.output
    (instance,) = built
    assert "vae_encoder" in instance.card.components
    assert set(instance.components) == {"transformer", "vae_decoder", "text_encoder"}
    assert instance.components["vae_decoder"].encoder is None  # the decoder component holds no encoder half


def _image_file(tmp_path: Path) -> Path:
    path = tmp_path / "cond.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


def test_generate_image_to_video(tmp_path: Path) -> None:
    out = tmp_path / "i2v.mp4"
    result = _invoke("generate", "--model", "wan-tiny-i2v", "--prompt", PROMPT, "--image", str(_image_file(tmp_path)),
                     "--quiet", "--steps", "2", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 0


def _unreadable(tmp_path: Path) -> str:
    path = tmp_path / "broken.png"
    path.write_bytes(b"this is not a PNG")
    return str(path)


BAD_INPUTS = [
    # (case, extra args, what the error line must contain)
    ("unknown card", ["--model", "wan-nope"], ["model: unknown card 'wan-nope'", "allowed:", "wan-tiny", "wan2.1-t2v-1.3b"]),
    ("height not /16", ["--model", "wan-tiny", "--height", "72"], ["height: 72", "allowed: multiples of 16"]),
    ("width not /16", ["--model", "wan-tiny", "--width", "100"], ["width: 100", "allowed: multiples of 16"]),
    ("frames not 4k+1", ["--model", "wan-tiny", "--frames", "10"], ["frames: 10", "allowed: 4k+1"]),
    ("i2v without image", ["--model", "wan-tiny-i2v", "--task", "image_to_video"], ["image:", "needs --image"]),
    ("unreadable image", ["--model", "wan-tiny-i2v", "--image", "<unreadable>"], ["image:", "not a readable image", "allowed: PNG"]),
    ("missing image file", ["--model", "wan-tiny-i2v", "--image", "/nonexistent/cond.png"], ["image:", "does not exist"]),
    ("steps zero", ["--model", "wan-tiny", "--steps", "0"], ["steps:", "greater than 0"]),
    ("steps negative", ["--model", "wan-tiny", "--steps", "-2"], ["steps:", "greater than 0"]),
    ("guidance without CFG", ["--model", "fastwan-tiny", "--guidance", "5"],
     ["guidance:", "'fastwan-tiny'", "without classifier-free guidance", "allowed: omit it, or a value <= 1"]),
    ("50-step unipc on DMD recipe", ["--model", "fastwan-tiny", "--sampler", "unipc", "--steps", "50"],
     ["sampler:", "recipe 'dmd2'", "assumes loop 'dmd_3step'", "'unipc' with 50 steps"]),
    ("frames over the card maximum", ["--model", "wan-tiny", "--frames", "41"], ["frames: 41", "allowed: <= 33"]),
]


@pytest.mark.parametrize("case, args, expected", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_naming_field_and_allowed_values(case: str, args: list[str], expected: list[str], tmp_path: Path) -> None:
    args = [_unreadable(tmp_path) if a == "<unreadable>" else a for a in args]
    out = tmp_path / "never.mp4"
    result = _invoke("generate", *args, "--prompt", PROMPT, "--quiet", "--output", str(out))
    assert result.exit_code == 2, f"{case}: exit {result.exit_code}\n{result.output}"
    line = _error_line(result)
    for fragment in expected:
        assert fragment in line, f"{case}: {fragment!r} not in {line!r}"
    assert not out.exists() and list(tmp_path.glob("never*")) == []


def test_recipe_mismatch_is_the_typed_error() -> None:
    from fv_kernel.api import DiffusionParams, RecipeMismatch, Request, TaskType, TextPart
    from fv_kernel.model.validate import resolve_request
    from fv_wan.cards import wan_cards

    (card,) = [c for c in wan_cards() if c.model_id == "fastwan-tiny"]
    request = Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=PROMPT),),
                      diffusion=DiffusionParams(sampler="unipc", steps=50))
    with pytest.raises(RecipeMismatch) as info:
        resolve_request(card, request)
    assert info.value.param == "sampler" and "dmd_3step" in info.value.assumes


def test_cards_list_shows_the_cards_with_their_recipes() -> None:
    result = _invoke("cards", "list", "--json")
    assert result.exit_code == 0, result.output
    import json

    rows = {row["model_id"]: row for row in json.loads(result.output[result.output.index("["):])}
    wan = {k: v for k, v in rows.items() if v["family"] == "wan"}
    assert set(wan) == {
        "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p", "wan2.2-ti2v-5b",
        "wan2.2-t2v-a14b", "fastwan2.1-t2v-1.3b", "wan-tiny", "wan-tiny-i2v", "wan-tiny-ti2v", "wan-tiny-a14b",
        "fastwan-tiny", "wan-toy", "wan-toy-init", "wan2.1-t2v-1.3b-causal", "wan-toy-causal",
    }
    assert wan["fastwan2.1-t2v-1.3b"]["recipe"] == "dmd2 (assumes loop dmd_3step) from wan2.1-t2v-1.3b"
    assert wan["wan-toy"]["recipe"] == "flow-matching from wan-toy-init"
    assert wan["wan2.1-t2v-1.3b"]["recipe"] == "base"
    assert wan["wan2.1-t2v-1.3b-causal"]["recipe"] == "self_forcing_dmd (assumes loop realtime) from wan2.1-t2v-1.3b"
    assert all(row["plugin"] == "fv-wan" and row["parity"] == "C1" for row in wan.values())
    table = _invoke("cards", "list")
    assert table.exit_code == 0
    for model_id in wan:
        (line,) = [l for l in table.output.splitlines() if l.split() and l.split()[0] == model_id]
        assert wan[model_id]["recipe"].split()[0] in line


def test_realtime_on_a_card_that_cannot_stream_names_the_causal_cards(tmp_path: Path) -> None:
    """``fv realtime --model wan-toy`` (no chunk_rollout loop): one line, naming the installed cards that can stream."""
    out = tmp_path / "o.mp4"
    result = CliRunner().invoke(app, ["realtime", "--model", "wan-toy", "--prompt", "a red circle moves left quickly on "
                                      "a black background", "--output", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.output
    assert "card 'wan-toy' has no chunk_rollout loop" in result.stderr and "allowed: " in result.stderr
    allowed = result.stderr.split("allowed: ", 1)[1].strip().split(", ")
    assert "wan-toy-causal" in allowed and "wan-toy" not in allowed and not out.exists()
