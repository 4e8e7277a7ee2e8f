"""The toy-world judge: it passes the generator's own clips and fails every kind of wrong clip."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fv_wan.toy import judge as judge_module
from fv_wan.toy.grammar import COLOURS, SHAPES, Scene, ToyGrammarError, colour_fits_background, parse_prompt
from fv_wan.toy.judge import Judgement, QualityScore, judge, score, summarise
from fv_wan.toy.world import ToyWorld, render

OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
# (height, width, frames, held_out): both sizes, short and long clips, both splits
CONFIGS = [(64, 64, 9, False), (64, 96, 17, True), (64, 64, 13, True), (64, 96, 9, False)]


def _clips(count: int, height: int, width: int, frames: int, held_out: bool, seed: int = 0):
    world = ToyWorld(frames=frames, height=height, width=width, seed=seed, held_out=held_out)
    scenes, seeds = world.scenes(0, count)
    return world.batch(0, count)[0], scenes, seeds


def _replace_first(scene: Scene, **changes: str) -> Scene:
    return Scene((dataclasses.replace(scene.objects[0], **changes), *scene.objects[1:]), scene.background)


@pytest.mark.parametrize(("height", "width", "frames", "held_out"), CONFIGS)
def test_ground_truth_clips_score_at_least_95_percent(height: int, width: int, frames: int, held_out: bool) -> None:
    videos, scenes, _ = _clips(60, height, width, frames, held_out, seed=height + width + frames)
    result = score(videos, [scene.prompt() for scene in scenes])
    assert result.clips == 60 and result.objects > 60
    for name in ("colour", "direction", "speed", "shape", "stability", "all_correct"):
        assert getattr(result, name) >= 0.95, (name, result)


def _wrong(scene: Scene, attribute: str) -> Scene:
    obj = scene.objects[0]
    if attribute == "colour":
        taken = {o.colour for o in scene.objects}
        other = next(c for c in COLOURS if c not in taken and colour_fits_background(c, scene.background))
        return _replace_first(scene, colour=other)
    if attribute == "direction":
        return _replace_first(scene, direction=OPPOSITE[obj.direction])
    if attribute == "speed":
        return _replace_first(scene, speed="slowly" if obj.speed == "quickly" else "quickly")
    return _replace_first(scene, shape=next(s for s in SHAPES if s != obj.shape))


@pytest.mark.parametrize("attribute", ["colour", "direction", "speed", "shape"])
def test_a_clip_of_another_prompt_is_scored_wrong(attribute: str) -> None:
    _, scenes, seeds = _clips(30, 64, 96, 9, False, seed=21)
    for scene, seed in zip(scenes, seeds):
        wrong = render(_wrong(scene, attribute), frames=9, height=64, width=96, seed=seed)
        verdict = judge(wrong, scene.prompt())
        assert not getattr(verdict.objects[0], attribute), (attribute, scene.prompt())
        assert not verdict.correct
        # the other object of a two-object scene is untouched and still judged right
        assert all(obj.correct for obj in verdict.objects[1:])


def test_noise_is_scored_wrong() -> None:
    generator = torch.Generator().manual_seed(0)
    _, scenes, _ = _clips(20, 64, 64, 9, False, seed=22)
    for scene in scenes:
        verdict = judge(torch.rand(9, 3, 64, 64, generator=generator), scene.prompt())
        assert not verdict.stable and not verdict.correct
        assert not any(obj.colour or obj.direction or obj.shape for obj in verdict.objects)


def test_shuffled_frames_fail_stability_and_frozen_frames_fail_direction() -> None:
    videos, scenes, _ = _clips(20, 64, 64, 9, False, seed=23)
    interleaved = torch.tensor([0, 2, 4, 6, 8, 1, 3, 5, 7])
    generator = torch.Generator().manual_seed(1)
    for video, scene in zip(videos, scenes):
        assert judge(video, scene.prompt()).correct
        assert not judge(video[interleaved], scene.prompt()).stable
        assert not judge(video[torch.randperm(9, generator=generator)], scene.prompt()).stable
        frozen = judge(video[:1].expand_as(video), scene.prompt())
        assert frozen.stable and not frozen.correct and not any(obj.direction for obj in frozen.objects)


def test_a_flickering_object_fails_stability() -> None:
    scene = parse_prompt("a red circle moves left quickly on a grey background")
    video = render(scene, frames=9, height=64, width=64, seed=0)
    blank = video.clone()
    blank[4] = 0.5  # the middle frame shows only the grey background
    verdict = judge(blank, scene.prompt())
    assert not verdict.stable and verdict.objects[0].colour  # present in 8 of 9 frames, but not all


def test_an_unprompted_object_makes_the_clip_wrong() -> None:
    two = parse_prompt("a red circle moves left quickly and a green square moves up slowly on a black background")
    video = render(two, frames=9, height=64, width=64, seed=1)
    verdict = judge(video, "a red circle moves left quickly on a black background")
    assert verdict.objects[0].correct and verdict.stable
    assert verdict.extra_colours == ("green",) and not verdict.correct


def test_blur_and_mild_noise_are_tolerated() -> None:
    videos, scenes, _ = _clips(30, 64, 64, 13, True, seed=24)
    kernel = torch.exp(-torch.arange(-3, 4).float() ** 2 / 2)  # Gaussian, sigma 1 pixel
    kernel = kernel / kernel.sum()
    flat = videos.flatten(0, 2)[:, None]
    flat = F.conv2d(F.pad(flat, (3, 3, 0, 0), mode="replicate"), kernel.view(1, 1, 1, 7))
    flat = F.conv2d(F.pad(flat, (0, 0, 3, 3), mode="replicate"), kernel.view(1, 1, 7, 1))
    noisy = (flat.view_as(videos) + 0.02 * torch.randn(videos.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    result = score(noisy, [scene.prompt() for scene in scenes])
    assert result.all_correct >= 0.95, result


def test_the_background_palette_rule_is_what_keeps_white_backgrounds_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: without excluding pixels that share the row background's palette colour,
    anti-aliased edges on a white background read as a flickering white object."""
    scene = parse_prompt("a cyan square moves left slowly and a blue square moves left slowly on a white background")
    video = render(scene, frames=13, height=64, width=64, seed=5)
    assert judge(video, scene.prompt()).correct

    def without_rule(video: torch.Tensor) -> torch.Tensor:
        frames, _, height, width = video.shape
        pixels = video.permute(0, 2, 3, 1).reshape(-1, 3)
        palette = torch.tensor([*judge_module.COLOUR_RGB.values(), *judge_module._ANCHOR_RGB.values()])
        distance, label = torch.cdist(pixels, palette).min(dim=1)
        background = video.median(dim=3, keepdim=True).values
        off = ((video - background) ** 2).sum(dim=1) > judge_module.BACKGROUND_MARGIN**2
        near = (distance < judge_module.COLOUR_RADIUS).view(frames, height, width) & off
        label = label.view(frames, 1, height, width)
        return (label == torch.arange(len(COLOURS)).view(1, -1, 1, 1)) & near[:, None]

    monkeypatch.setattr(judge_module, "_colour_masks", without_rule)
    verdict = judge(video, scene.prompt())
    assert not verdict.stable and not verdict.correct


def test_score_aggregates_per_object_and_per_clip() -> None:
    videos, scenes, seeds = _clips(6, 64, 64, 9, False, seed=25)
    prompts = [scene.prompt() for scene in scenes]
    wrong = torch.stack([render(_wrong(s, "colour"), frames=9, height=64, width=64, seed=seed) for s, seed in zip(scenes, seeds)])
    result = score(torch.cat([videos, wrong]), prompts + prompts)
    objects = 2 * sum(len(s.objects) for s in scenes)
    assert isinstance(result, QualityScore) and result.clips == 12 and result.objects == objects
    assert result.all_correct == 0.5
    assert result.colour == pytest.approx(1 - len(scenes) / objects)  # one wrong object per wrong clip
    assert result.as_dict()["clips"] == 12
    judgements = [judge(v, p) for v, p in zip(videos, prompts)]
    assert all(isinstance(j, Judgement) for j in judgements) and summarise(judgements).all_correct == 1.0


@pytest.mark.parametrize(
    ("video", "message"),
    [
        (torch.zeros(9, 64, 64), r"shape \(F, 3, H, W\)"),
        (torch.zeros(9, 4, 64, 64), r"shape \(F, 3, H, W\)"),
        (torch.zeros(1, 3, 64, 64), r"F >= 2"),
        (torch.zeros(9, 3, 64, 64, dtype=torch.uint8), "floating point"),
        (torch.full((9, 3, 64, 64), 2.0), r"in \[0, 1\]"),
        ("frames", "torch.Tensor"),
    ],
)
def test_bad_videos_are_typed_errors(video: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        judge(video, "a red circle moves left slowly on a black background")  # type: ignore[arg-type]


def test_bad_prompts_and_mismatched_lists_are_typed_errors() -> None:
    video = torch.zeros(9, 3, 64, 64)
    with pytest.raises(ToyGrammarError) as caught:
        judge(video, "a red fox")
    assert caught.value.field == "shape" and caught.value.word == "fox"
    with pytest.raises(ValueError, match="differ in length"):
        score([video], [])
    with pytest.raises(ValueError, match="at least one"):
        score([], [])


def test_the_docs_python_example_prints_what_it_says() -> None:
    import contextlib
    import io
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "models" / "toy-world.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"<!-- doc-test: python.*?-->\n```python\n(.*?)```", doc, flags=re.S)
    expected = [line[len("# -> "):] for line in block.splitlines() if line.startswith("# -> ")]
    assert len(expected) == 3
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "toy-world.md", "exec"), {})
    assert out.getvalue().splitlines() == expected


def test_the_quality_bench_runs_on_ground_truth(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """bench/bench_toy_quality.py --ground-truth: the judge's ceiling at a card's size, as the docs show."""
    import json

    from bench_module import load_bench

    bench = load_bench("bench_toy_quality")
    out = tmp_path / "gt.json"
    monkeypatch.setattr("sys.argv", ["bench_toy_quality.py", "--model", "wan-tiny", "--ground-truth", "--n", "6",
                                     "--json", str(out)])
    assert bench.main() == 0
    assert "toy world ground truth: 6 held-out prompts" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["all_correct"] == 1.0 and row["clips"] == 6 and len(row["verdicts"]) == 6
    monkeypatch.setattr("sys.argv", ["bench_toy_quality.py", "--model", "wan-tiny", "--render-throughput", "4",
                                     "--batches", "1", "--json", str(out)])
    assert bench.main() == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 4 and row["clips_per_s"] > 0 and row["cpu_part_clips_per_s"] > 0
    monkeypatch.setattr("sys.argv", ["bench_toy_quality.py", "--model", "no-such-card", "--ground-truth"])
    with pytest.raises(SystemExit, match="--model: .*no-such-card"):
        bench.main()
