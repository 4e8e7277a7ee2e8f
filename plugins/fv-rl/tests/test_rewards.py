"""The offline rewards, registered through the host."""

from __future__ import annotations

import pytest
import torch

from fv_kernel.api import InvalidRequest, RecipeError, resolve_reward
from fv_rl.rewards import BrightnessReward, ColourReward, MotionReward


def _solid(rgb, frames=3, size=8):
    return torch.tensor(rgb, dtype=torch.float32).view(1, 3, 1, 1).expand(frames, 3, size, size).clone()


def test_colour_reward_prefers_the_prompted_colour():
    videos = torch.stack([_solid((1, 0, 0)), _solid((0, 0, 1)), _solid((0.5, 0.5, 0.5))])
    red = ColourReward().score(videos, ["a red fox"] * 3)
    assert red[0] == 1.0 and red[1] == -0.5 and red[2] == 0.0
    blue = ColourReward().score(videos, ["a Blue lake"] * 3)
    assert blue[1] == 1.0 and blue[0] == -0.5


def test_motion_reward_signs_by_the_prompt():
    video = torch.zeros(4, 3, 8, 16)
    for f in range(4):
        video[f, :, 3:5, 2 + 3 * f : 4 + 3 * f] = 1.0  # a bright square moving right
    videos = torch.stack([video, video.flip(-1)])
    right = MotionReward().score(videos, ["a square moves right", "a square moves right"])
    assert right[0] > 0.4 and right[1] < -0.4
    left = MotionReward().score(videos, ["it moves left", "it moves left"])
    torch.testing.assert_close(left, -right)


def test_brightness_reward_peaks_at_its_target():
    videos = torch.stack([_solid((0.8, 0.8, 0.8)), _solid((0.2, 0.2, 0.2))])
    scores = BrightnessReward(BrightnessReward.options_schema(target=0.8)).score(videos, ["a", "b"])
    assert abs(float(scores[0])) < 1e-6 and scores[1] < -0.5


def test_a_prompt_the_reward_cannot_read_names_the_field():
    with pytest.raises(InvalidRequest, match="prompt.*names no colour"):
        ColourReward().score(torch.stack([_solid((1, 0, 0))]), ["a fox"])
    with pytest.raises(InvalidRequest, match="prompts"):
        ColourReward().score(torch.stack([_solid((1, 0, 0))]), ["a red fox", "two"])


def test_toy_judge_reward_scores_a_rendered_toy_clip_above_noise():
    from fv_wan.toy.world import ToyWorld

    videos, prompts = ToyWorld(frames=9, height=64, width=64, seed=0).batch(0, 2, device=torch.device("cpu"))
    reward = resolve_reward("toy-judge")
    rendered = reward.score(videos, list(prompts))
    noise = reward.score(torch.rand_like(videos), list(prompts))
    assert (rendered > noise).all() and rendered.min() > 0.5


def test_rewards_resolve_through_the_host_with_typed_errors():
    assert isinstance(resolve_reward("colour"), ColourReward)
    assert resolve_reward("fv-rl/brightness", {"target": 0.3}).options.target == 0.3
    with pytest.raises(RecipeError, match="options.reward: no registered reward 'clip'.*colour"):
        resolve_reward("clip")
    with pytest.raises(RecipeError, match="options.reward_options.target"):
        resolve_reward("brightness", {"target": 3})
