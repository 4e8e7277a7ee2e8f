"""The card's declared ``ProgramSpec.returns`` match what Cosmos3Program returns, and a
request's ``output.modalities`` picks among them (the rewritten prompt is text)."""

from __future__ import annotations

import pytest
import torch

from fv_cosmos3.cards import cosmos3_card
from fv_kernel.api import (
    ARParams,
    DiffusionParams,
    Engine,
    ImagePart,
    InvalidRequest,
    OutputSpec,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    VideoPart,
    build_instance,
)

CARD = cosmos3_card("cosmos3-tiny")
FAST = DiffusionParams(steps=2)


@pytest.fixture(scope="module")
def engine() -> Engine:
    e = Engine(SchedulerConfig(device_thread=False))
    e.add_instance(build_instance(CARD))
    return e


def request(task: TaskType, *parts: object, **changes: object) -> Request:
    return Request(model="cosmos3-tiny", task=task, inputs=(TextPart(text="a robot arm"), *parts),  # type: ignore[arg-type]
                   diffusion=FAST, ar=ARParams(max_tokens=4), **changes)  # type: ignore[arg-type]


def test_upsampled_prompt_text_is_returned_only_when_asked_for(engine: Engine) -> None:
    both = engine.generate(request(TaskType.TEXT_TO_VIDEO, prompt_upsampling=True))
    assert [a.kind for a in both.artifacts] == ["text", "video"]
    video_only = engine.generate(request(TaskType.TEXT_TO_VIDEO, prompt_upsampling=True,
                                         output=OutputSpec(modalities=frozenset({"video"}))))
    assert [a.kind for a in video_only.artifacts] == ["video"]
    assert torch.equal(video_only.artifacts[0].frames, both.artifacts[1].frames)  # same generation, text dropped


@pytest.mark.parametrize(
    ("task", "parts", "kinds"),
    [
        (TaskType.TEXT_GENERATION, (), ["text"]),
        (TaskType.ACTION_POLICY, (ImagePart(image=torch.rand(3, 32, 64)),), ["tensor", "video"]),
        (TaskType.INVERSE_DYNAMICS, (VideoPart(frames=torch.rand(5, 3, 32, 64), fps=24.0),), ["tensor", "video"]),
    ],
)
def test_declared_returns_cover_what_the_program_returns(engine: Engine, task: TaskType, parts: tuple, kinds: list) -> None:
    result = engine.generate(request(task, *parts))
    assert result.status == "completed", result.error
    assert sorted(a.kind for a in result.artifacts) == kinds
    declared = CARD.artifact_kinds(task)
    assert declared is not None and set(kinds) <= declared


def test_a_kind_the_task_never_returns_is_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest) as info:
        engine.validate(request(TaskType.TEXT_TO_VIDEO, output=OutputSpec(modalities=frozenset({"audio"}))))
    assert info.value.param == "output.modalities" and info.value.allowed == ["text", "video"]
