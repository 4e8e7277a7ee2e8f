"""Helpers shared by fv-cachedit's tests: card lookup, request factory, state capture."""

from __future__ import annotations

from typing import Any

from fv_kernel.card.spec import ModelCard
from fv_kernel.loop.contract import LoopState
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType


def wan_card(model_id: str) -> ModelCard:
    from fv_wan.cards import wan_cards

    return next(card for card in wan_cards() if card.model_id == model_id)


def any_card(model_id: str) -> ModelCard:
    if model_id.startswith("toy-"):
        from fv_kernel.testing.toy import toy_card

        return toy_card(model_id)
    return wan_card(model_id)


def t2v(model: str, seed: int = 0, *, steps: int = 12, params: dict[str, Any] | None = None, **kw: Any) -> Request:
    """A small text-to-video request (frames/size from the card's defaults)."""
    return Request(
        request_id=kw.pop("request_id", f"{model}-{seed}"), model=model, task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text=f"a red fox runs through snow {seed}"), TextPart(text="blurry", role="negative_prompt")),
        diffusion=DiffusionParams(seed=seed, steps=steps), plugin_params=params or {}, **kw,
    )


class StateCapture:
    """An ``on_state`` hook keeping the last state of every loop that has plugin state."""

    def __init__(self) -> None:
        self.states: dict[str, LoopState] = {}

    def __call__(self, state: LoopState) -> None:
        if state.plugin_state:
            self.states[state.loop_id] = state
        return None

    def plugin(self, plugin_id: str) -> dict[str, Any]:
        [state] = [s for s in self.states.values() if plugin_id in s.plugin_state]
        return state.plugin_state[plugin_id]
