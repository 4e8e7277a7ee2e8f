"""Rewards that need no download (the ``rewards`` contribution kind).

- ``colour``: the prompt names a colour; reward = mean of its channels minus mean of the others
  over every pixel of every frame (in [-1, 1]).
- ``motion``: the prompt says ``left`` or ``right``; reward = the brightness-weighted centroid's
  x displacement from the first to the last frame, as a fraction of the width, signed by the prompt.
- ``brightness``: reward = -|mean luminance - target| (target from the options).
- ``toy-judge``: the wan-toy judge (``fv_wan.toy.judge``, when fv-wan is installed): the share of
  the prompt's attribute checks (colour, direction, speed, shape per object, and stability) it passes.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from fv_kernel.api import InvalidRequest, Reward

__all__ = ["ColourReward", "MotionReward", "BrightnessReward", "ToyJudgeReward", "COLOURS"]

#: Colour words and the RGB channels they light (the others are pushed down).
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1),
    "yellow": (1, 1, 0), "cyan": (0, 1, 1), "magenta": (1, 0, 1), "purple": (1, 0, 1),
}


def _check(videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or videos.shape[2] != 3:
        raise InvalidRequest("videos", f"expected a tensor (B, F, 3, H, W), got {getattr(videos, 'shape', type(videos))}")
    if len(prompts) != videos.shape[0]:
        raise InvalidRequest("prompts", f"{len(prompts)} prompts for {videos.shape[0]} videos")
    return videos.float()


def _word(prompt: str, words: dict[str, object] | tuple[str, ...], what: str) -> str:
    found = [w for w in re.findall(r"[a-z]+", prompt.lower()) if w in words]
    if not found:
        raise InvalidRequest("prompt", f"{prompt!r} names no {what}", allowed=sorted(words))
    return found[0]


class ColourReward(Reward):
    name: ClassVar[str] = "colour"

    def score(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        videos = _check(videos, prompts)
        channel_means = videos.mean(dim=(1, 3, 4))  # (B, 3)
        rewards = []
        for means, prompt in zip(channel_means, prompts):
            target = torch.tensor(COLOURS[_word(prompt, COLOURS, "colour")], dtype=torch.float32)
            rewards.append((means * target).sum() / target.sum() - (means * (1 - target)).sum() / (1 - target).sum())
        return torch.stack(rewards)


class MotionReward(Reward):
    name: ClassVar[str] = "motion"

    def score(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        videos = _check(videos, prompts)
        luminance = videos.mean(dim=2)  # (B, F, H, W)
        weights = luminance.sum(dim=2)  # (B, F, W): brightness per column
        columns = torch.arange(videos.shape[-1], dtype=torch.float32)
        centroid = (weights * columns).sum(-1) / weights.sum(-1).clamp_min(1e-6)  # (B, F)
        displacement = (centroid[:, -1] - centroid[:, 0]) / videos.shape[-1]
        sign = torch.tensor([1.0 if _word(p, ("left", "right"), "direction") == "right" else -1.0 for p in prompts])
        return sign * displacement


class BrightnessOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The mean luminance (in [0, 1]) the reward peaks at.
    target: float = Field(default=0.8, ge=0, le=1)


class BrightnessReward(Reward):
    name: ClassVar[str] = "brightness"
    options_schema: ClassVar[type[BaseModel]] = BrightnessOptions

    def score(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        videos = _check(videos, prompts)
        target = self.options.target  # type: ignore[attr-defined]
        return -(videos.mean(dim=(1, 2, 3, 4)) - target).abs()


class ToyJudgeReward(Reward):
    """The wan-toy card's judge as a reward; needs fv-wan (its toy world) installed."""

    name: ClassVar[str] = "toy-judge"

    def score(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        videos = _check(videos, prompts)
        try:
            from fv_wan.toy.judge import judge
        except ImportError:
            raise InvalidRequest("reward", "toy-judge needs fv-wan (pip install ./plugins/fv-wan)") from None
        scores = []
        for video, prompt in zip(videos, prompts):
            try:
                verdict = judge(video, prompt)
            except ValueError as exc:
                raise InvalidRequest("prompt", f"{prompt!r}: {exc}") from None
            checks = [c for obj in verdict.objects for c in (obj.colour, obj.direction, obj.speed, obj.shape)]
            checks.append(verdict.stable and not verdict.extra_colours)
            scores.append(sum(checks) / len(checks))
        return torch.tensor(scores, dtype=torch.float32)
