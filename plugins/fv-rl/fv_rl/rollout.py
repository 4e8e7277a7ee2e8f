"""Rollouts are ordinary Engine requests (design §10): the serving loops plus behaviour capture.

A group of K samples of one prompt is K requests with K seeds, submitted at one priority
class. They share one shape signature, so the scheduler runs their denoise steps as one
homogeneous batch of WorkUnits; the text encoder runs once per group: the first request
goes ahead, and the others are submitted once its first denoise step has run -- its prompt
embedding is in the engine's feature cache by then, so theirs are cache hits. Rollouts
interleave with whatever else the engine serves under the one scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from fv_kernel.api import (
    BehaviorRecord,
    DiffusionParams,
    Engine,
    OutputSpec,
    Request,
    StepFailed,
    TaskType,
    TextPart,
    VideoArtifact,
    check_envelope,
    resolve_request,
)

__all__ = ["RolloutSettings", "Rollout", "rollout_group", "rollout_groups"]


class RolloutSettings(BaseModel):
    """How rollouts sample: the loop parameters of their requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: PositiveInt = 6
    #: 1.0: classifier-free guidance off (the methods train the conditional velocity).
    guidance: float = Field(default=1.0, ge=0)
    height: PositiveInt | None = None
    width: PositiveInt | None = None
    frames: PositiveInt | None = None
    #: A registered sampler name for the requests; None: the card loop's own binding.
    sampler: str | None = None
    capture: Literal["final", "steps"] = "final"
    #: The scheduling class rollouts run at next to serving traffic.
    priority: Literal["interactive", "batch"] = "batch"

_log = logging.getLogger("fv.rl")


@dataclass(frozen=True)
class Rollout:
    prompt: str
    seed: int
    record: BehaviorRecord
    #: The decoded video (F, 3, H, W) in [0, 1].
    video: torch.Tensor
    request_id: str


def _request(model_id: str, prompt: str, seed: int, s: RolloutSettings) -> Request:
    return Request(
        model=model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),), priority=s.priority,
        diffusion=DiffusionParams(steps=s.steps, guidance=s.guidance, height=s.height, width=s.width, frames=s.frames,
                                  sampler=s.sampler, seed=seed),
        output=OutputSpec(capture_behavior=s.capture),
        # A training config names its rollout geometry on purpose (fine-tuning at another size than
        # the card was trained at is what it asks for): the envelope is overridden, and said once
        # per batch of groups (rollout_groups).
        allow_outside_envelope=True,
    )


async def rollout_group(
    engine: Engine, model_id: str, prompt: str, seeds: Sequence[int], settings: RolloutSettings, *, stagger: bool = True
) -> list[Rollout]:
    """K = len(seeds) samples of ``prompt`` through ``engine`` (running), with their behaviour records.

    ``stagger=False`` submits all K at once (then each request misses the cache and the
    encoder runs on K rows): kept for the test that shows why the group staggers.
    """
    requests = [_request(model_id, prompt, seed, settings) for seed in seeds]
    first = engine.submit(requests[0])
    if stagger and len(requests) > 1:
        async for event in first.events():
            if event.type in ("behavior.slice", "request.completed", "request.failed", "request.cancelled"):
                break
    handles = [first, *(engine.submit(r) for r in requests[1:])]
    results = await asyncio.gather(*(h.result() for h in handles))
    rollouts = []
    for request, result in zip(requests, results):
        if result.status != "completed":
            reason = result.error.message if result.error is not None else result.status
            raise StepFailed(f"rollout {request.request_id} ({prompt!r}, seed {request.diffusion.seed}) {result.status}: {reason}")
        record = result.artifact("behavior")
        video = result.artifact("video")
        assert isinstance(record, BehaviorRecord) and isinstance(video, VideoArtifact)
        rollouts.append(Rollout(prompt=prompt, seed=request.diffusion.seed, record=record, video=video.frames,
                                request_id=request.request_id))
    return rollouts


async def rollout_groups(
    engine: Engine, model_id: str, prompts: Sequence[str], seeds: Sequence[Sequence[int]], settings: RolloutSettings
) -> list[list[Rollout]]:
    """One group per prompt (``seeds[i]`` for ``prompts[i]``), all groups at once under the one scheduler.

    Where the rollouts leave the card's trained envelope (another size, unknown prompt words),
    each departure is logged once as a warning on the ``fv.rl`` logger."""
    card = engine.instances[model_id].card
    departures = dict.fromkeys(message for prompt in prompts
                               for message in check_envelope(card, resolve_request(card, _request(model_id, prompt, 0, settings))))
    for message in departures:
        _log.warning("rollouts of %s: %s", model_id, message)
    return list(await asyncio.gather(*(rollout_group(engine, model_id, p, s, settings) for p, s in zip(prompts, seeds))))
