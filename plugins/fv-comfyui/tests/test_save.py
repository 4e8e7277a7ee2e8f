"""The save nodes' files: formats, ComfyUI's names and counters, 8-bit conversion, no escape from the output folder."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fv_comfyui.compile import SaveTarget
from fv_comfyui.run import OutputFileError, frames_uint8, save_outputs


def _video(frames: int = 3) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(0)
    return SimpleNamespace(frames=torch.rand(frames, 3, 16, 16, generator=gen))


def test_frames_become_8_bit_as_comfyui_truncates() -> None:
    frames = torch.tensor([0.0, 0.5, 0.999, 1.0, 1.2]).view(5, 1, 1, 1).expand(5, 3, 1, 1)
    out = frames_uint8(frames)
    assert out.shape == (5, 1, 1, 3) and out[:, 0, 0, 0].tolist() == [0, 127, 254, 255, 255]


def test_each_format_is_written_and_readable(tmp_path: Path) -> None:
    import av
    from PIL import Image

    targets = [
        SaveTarget("28", "SaveAnimatedWEBP", "webp", "ComfyUI", 16.0, {"lossless": True, "quality": 80, "method": "default"}),
        SaveTarget("47", "SaveWEBM", "webm", "ComfyUI", 16.0, {"codec": "vp9", "crf": 32.0}),
        SaveTarget("9", "SaveVideo", "mp4", "video/ComfyUI", 8.0, {"codec": "auto", "format": "auto"}),
    ]
    video = _video()
    saved = save_outputs(video, targets, tmp_path)
    # one counter per folder and prefix, whatever the extension (ComfyUI's get_save_image_path)
    assert [(s.filename, s.subfolder) for s in saved] == [
        ("ComfyUI_00001_.webp", ""), ("ComfyUI_00002_.webm", ""), ("ComfyUI_00001_.mp4", "video")]
    with Image.open(tmp_path / "ComfyUI_00001_.webp") as webp:
        assert webp.n_frames == 3
        webp.seek(1)
        # lossless: the second frame comes back exactly
        assert np.array_equal(np.asarray(webp.convert("RGB")), frames_uint8(video.frames)[1])
    for name in ("ComfyUI_00002_.webm", "video/ComfyUI_00001_.mp4"):
        with av.open(str(tmp_path / name)) as container:
            assert sum(1 for _ in container.decode(video=0)) == 3
    # the counter continues past what is there, as ComfyUI's does
    again = save_outputs(video, targets[:1], tmp_path)
    assert again[0].filename == "ComfyUI_00003_.webp"
    assert again[0].history_entry() == {"filename": "ComfyUI_00003_.webp", "subfolder": "", "type": "output"}


@pytest.mark.parametrize("prefix", ["../escape", "/abs/path", "a/../../b"])
def test_a_prefix_outside_the_output_folder_is_refused(tmp_path: Path, prefix: str) -> None:
    target = SaveTarget("28", "SaveAnimatedWEBP", "webp", prefix, 8.0, {"lossless": False, "quality": 80, "method": "default"})
    with pytest.raises(OutputFileError, match="outside the output folder"):
        save_outputs(_video(), [target], tmp_path / "out")
