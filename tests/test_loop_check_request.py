"""``Loop.check_request``: a loop refuses, at validation, a request it could never run; validation
resolves which of a program's loops override it once per instance, not on every request."""

from __future__ import annotations

from typing import Any

import pytest

from fv_kernel.api import DiffusionParams, InvalidRequest, ModelCard, Request, TaskType, TextPart, build_instance
from fv_kernel.model.validate import resolve_for_instance
from fv_kernel.testing.toy import ToyDenoiseLoop, toy_card


class TallRefusingDenoiseLoop(ToyDenoiseLoop):
    """The toy denoise loop, refusing frames over 32 pixels high (as a causal card's slabs bound its frame)."""

    def check_request(self, request: Request, model: Any) -> None:
        if request.diffusion.height is not None and request.diffusion.height > 32:
            raise InvalidRequest("height", f"{request.diffusion.height} is over this loop's 32", allowed="<= 32")


def _card() -> ModelCard:
    data = toy_card("toy-dit").model_dump()
    data["loops"]["denoise"]["implementation"] = f"{__name__}:TallRefusingDenoiseLoop"
    return ModelCard.model_validate(data)


def _request(height: int) -> Request:
    return Request(request_id=f"r{height}", model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a kite"),),
                   diffusion=DiffusionParams(height=height, width=32, frames=5, steps=2, seed=0))


def test_a_loop_refuses_at_validation_what_it_cannot_run() -> None:
    instance = build_instance(_card())
    assert resolve_for_instance(instance, _request(32)).diffusion.height == 32
    with pytest.raises(InvalidRequest) as info:
        resolve_for_instance(instance, _request(64))
    assert info.value.param == "height" and "over this loop's 32" in str(info.value)


def test_the_checking_loops_are_resolved_once_per_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    instance = build_instance(_card())
    program_loops = instance.card.programs[TaskType.TEXT_TO_VIDEO].loops
    resolved: list[str] = []
    loop_class = instance.loop_class

    def counting(loop_id: str) -> Any:
        resolved.append(loop_id)
        return loop_class(loop_id)

    monkeypatch.setattr(instance, "loop_class", counting)
    resolve_for_instance(instance, _request(32))
    # the first request resolves each program loop, and builds the one that checks
    assert sorted(resolved) == sorted([*program_loops, "denoise"])
    for _ in range(3):
        resolve_for_instance(instance, _request(32))
    assert len(resolved) == len(program_loops) + 1  # later requests resolve nothing
    assert instance.request_checking_loops(TaskType.TEXT_TO_VIDEO) == ("denoise",)


def test_a_program_of_plain_loops_checks_nothing() -> None:
    instance = build_instance(toy_card("toy-dit"))
    assert instance.request_checking_loops(TaskType.TEXT_TO_VIDEO) == ()
    assert resolve_for_instance(instance, _request(64)).diffusion.height == 64
