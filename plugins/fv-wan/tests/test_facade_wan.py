"""The Python façade on real Wan cards: the README's example runs as written, and ``fv.load``
takes what ``fv generate --model`` takes (a card id, a checkpoint directory), giving the same
video as the CLI for the same options (text- and image-to-video)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from typer.testing import CliRunner

import fv_kernel as fv
from fv_kernel.api import InvalidRequest
from fv_kernel.cli.app import app
from tiny_wan_checkpoints import tiny_transformer_config, tiny_vae_config, write_checkpoint

REPO = Path(__file__).resolve().parents[3]
PROMPT = "a red fox runs through fresh snow"


def readme_python_blocks() -> list[str]:
    """The ```python blocks of the README's "From Python" section, in order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^### From Python\n(.*?)(?=^#{1,3} )", text, flags=re.S | re.M)
    assert section, "README.md has no '### From Python' section"
    return re.findall(r"^```python\n(.*?)^```", section.group(1), flags=re.S | re.M)


def test_the_readme_python_examples_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    av = pytest.importorskip("av")
    facade, engine = readme_python_blocks()
    assert "fv.load(" in facade and "Engine()" in engine  # the façade first, the lower-level example after it
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(facade, "README.md (From Python, block 1)", "exec"), scope)  # noqa: S102 - the doc example, as written
    gen, video, videos, event = scope["gen"], scope["video"], scope["videos"], scope["event"]
    d = gen.card.capabilities.defaults  # whichever card the README names, at its defaults
    assert isinstance(video, fv.Video) and tuple(video.frames.shape) == (d.frames, 3, d.height, d.width) and video.fps == d.fps
    assert video.provenance.model_id == gen.model_id and video.provenance.seed == 7
    assert len(videos) == 2 and all(isinstance(v, fv.Video) for v in videos)
    assert isinstance(event, fv.Finished) and event.video.frames.shape[0] == d.frames
    with av.open("fox.mp4") as container:
        assert sum(1 for _ in container.decode(video=0)) == d.frames
    assert Path("fox-streamed.gif").stat().st_size > 0
    exec(compile(engine, "README.md (From Python, block 2)", "exec"), {})  # noqa: S102
    with av.open("fox-engine.mp4") as container:
        assert sum(1 for _ in container.decode(video=0)) > 0


def test_the_readme_block_check_reads_the_section(tmp_path: Path) -> None:
    # Negative control: the extraction finds the section's blocks, and only those.
    blocks = readme_python_blocks()
    assert len(blocks) == 2 and blocks[0].startswith("import fv_kernel as fv")
    assert not any("fv cards list" in b for b in blocks)


def _cli_frames(tmp_path: Path, model: str, *extra: str) -> torch.Tensor:
    out = tmp_path / f"cli-{len(list(tmp_path.iterdir()))}.pt"
    result = CliRunner().invoke(app, ["generate", "--quiet", "--model", model, "--prompt", PROMPT, "--output", str(out), *extra])
    assert result.exit_code == 0, result.output
    return torch.load(out)


def test_a_checkpoint_directory_gives_what_fv_generate_gives(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "My Wan-T2V", transformer=tiny_transformer_config(),
                            vae=tiny_vae_config(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    gen = fv.load(str(root))
    assert gen.model_id != "wan-tiny" and gen.instance.options.source == str(root)
    video = gen.generate(PROMPT, seed=5, steps=2)
    assert torch.equal(video.frames, _cli_frames(tmp_path, str(root), "--seed", "5", "--steps", "2"))
    assert not torch.equal(video.frames, gen.generate(PROMPT, seed=6, steps=2).frames)  # the comparison can fail


def test_image_to_video_takes_a_path_a_pil_image_or_a_tensor_like_fv_generate(tmp_path: Path, condition_image: Any) -> None:
    pil, tensor = condition_image(64, 64, 3)
    path = tmp_path / "cond.png"
    pil.save(path)
    gen = fv.load("wan-tiny-i2v")
    images = [gen.request(PROMPT, image=form).part("image").image for form in (str(path), path, pil, tensor)]
    assert all(torch.equal(image, tensor) for image in images)
    assert gen.request(PROMPT, image=tensor).task.value == "image_to_video"
    video = gen.generate(PROMPT, image=path, seed=2, steps=2)
    assert torch.equal(video.frames, _cli_frames(tmp_path, "wan-tiny-i2v", "--image", str(path), "--seed", "2", "--steps", "2"))
    with pytest.raises(InvalidRequest, match="image: .*does not exist") as info:
        gen.generate(PROMPT, image=tmp_path / "missing.png")
    assert info.value.param == "image"
    with pytest.raises(InvalidRequest, match=r"image: task 'image_to_video' needs input part\(s\) \['image'\]") as info:
        gen.generate(PROMPT, task="image_to_video")
    assert info.value.param == "image"


def test_the_messages_docs_python_md_shows(tmp_path: Path) -> None:
    gen = fv.load("wan-tiny")
    with pytest.raises(InvalidRequest) as info:
        gen.generate("a red fox", steps=100000)
    assert info.value.message == "steps: 100000 exceeds the maximum of card 'wan-tiny'; allowed: 1..1000"
    with pytest.raises(InvalidRequest, match="serves 'wan-tiny' in 'fp32' only") as info:
        gen.generate("a red fox", precision="bf16")  # a call may name the loaded precision, not change it
    assert info.value.param == "precision" and gen.generate("a red fox", precision="fp32", steps=1).frames.dtype == torch.float32
    with pytest.raises(InvalidRequest) as info:
        fv.load("wan-tiny", precision="fp16")
    assert info.value.message.startswith("precision: card 'wan-tiny' does not support 'fp16'; ")
    doc = " ".join((REPO / "docs" / "python.md").read_text(encoding="utf-8").split())
    for shown in ("steps: 100000 exceeds the maximum of card 'wan-tiny'; allowed: 1..1000",
                  "precision: card 'wan-tiny' does not support 'fp16'"):
        assert shown in doc


def test_load_without_a_model_takes_the_plugins_default_card() -> None:
    from fv_kernel.plugins import PluginHost

    host = PluginHost()
    host.start()
    assert fv.load().model_id == host.hooks.default_model() is not None
