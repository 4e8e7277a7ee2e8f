"""A new user's first run of ``fv``: bad input is refused before any compute with one line,
the card's declared bounds are enforced in the one place requests are resolved, the CLI is
light and polite (``-h``, no torch for ``fv --help``, 80 columns), and the README's commands
are the ones CI runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fv_kernel.card.spec import CapabilityMatrix, ModelCard, TokenGridRule
from fv_kernel.card.validate import resolve_request
from fv_kernel.errors import InvalidRequest
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.testing.toy import toy_card

ROOT = Path(__file__).resolve().parents[1]


def card_with(model_id: str = "toy-dit", **capabilities: Any) -> ModelCard:
    """A toy card whose capabilities carry ``capabilities`` (validated as a card file would be)."""
    data = json.loads(toy_card(model_id).model_dump_json())
    data["capabilities"].update(capabilities)
    return ModelCard.model_validate(data)


def t2v(card: ModelCard, prompt: str = "a red fox", **diffusion: Any) -> Request:
    return Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
                   diffusion=DiffusionParams(**diffusion))


# --------------------------------------------------------------------------- card bounds in resolve_request


def test_steps_beyond_the_cards_maximum_are_refused_naming_it() -> None:
    card = card_with(max_steps=50)
    with pytest.raises(InvalidRequest) as info:
        resolve_request(card, t2v(card, steps=100000))
    assert info.value.param == "steps" and info.value.message.endswith("allowed: 1..50")
    assert resolve_request(card, t2v(card, steps=50)).diffusion.steps == 50
    # Negative control: a card that declares no maximum takes any count.
    unbounded = card_with()
    assert resolve_request(unbounded, t2v(unbounded, steps=100000)).diffusion.steps == 100000


def test_fps_outside_the_cards_range_is_refused() -> None:
    card = card_with(min_fps=1.0, max_fps=60.0)
    for fps in (0.0001, 61.0):
        with pytest.raises(InvalidRequest, match=r"^fps: .* allowed: 1\.\.60$"):
            resolve_request(card, t2v(card, fps=fps))
    assert resolve_request(card, t2v(card, fps=60.0)).diffusion.fps == 60.0
    unbounded = card_with()
    assert resolve_request(unbounded, t2v(unbounded, fps=0.0001)).diffusion.fps == 0.0001


def test_a_size_beyond_the_token_grid_is_refused_by_axis() -> None:
    # toy-dit: spatial multiple 8, frames 2k+1; a table of 4 positions per axis.
    rule = {"max_per_axis": 4, "frames_per_latent": 2, "pixels_per_token": 8}
    card = card_with(token_grid=rule)
    assert TokenGridRule(**rule).max_side == 32 and TokenGridRule(**rule).max_frames == 7
    for field, asked, allowed in (("height", {"height": 40}, 32), ("width", {"width": 40}, 32), ("frames", {"frames": 9}, 7)):
        with pytest.raises(InvalidRequest) as info:
            resolve_request(card, t2v(card, **asked))
        assert info.value.param == field and f"allowed: {field} <= {allowed}" in info.value.message
        assert "beyond its positional table of 4 per axis" in info.value.message
    resolved = resolve_request(card, t2v(card, height=32, width=32, frames=7))
    assert (resolved.diffusion.height, resolved.diffusion.width, resolved.diffusion.frames) == (32, 32, 7)
    unbounded = card_with()
    assert resolve_request(unbounded, t2v(unbounded, height=40)).diffusion.height == 40


def test_a_card_whose_defaults_break_its_own_bounds_does_not_validate() -> None:
    for bad in ({"max_steps": 3}, {"min_fps": 10.0}, {"max_fps": 4.0},
                {"token_grid": {"max_per_axis": 1, "pixels_per_token": 8}}, {"min_fps": 9.0, "max_fps": 2.0}):
        with pytest.raises(ValidationError):
            card_with(**bad)
    card_with(max_steps=4, min_fps=8.0, max_fps=8.0)  # the toy defaults: 4 steps at 8 fps


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_an_empty_prompt_is_refused_for_tasks_that_need_text(prompt: str) -> None:
    card = toy_card("toy-dit")
    with pytest.raises(InvalidRequest, match=r"^prompt: task 'text_to_video' needs a prompt"):
        resolve_request(card, t2v(card, prompt))
    lm = toy_card("toy-lm")
    with pytest.raises(InvalidRequest, match=r"^prompt: task 'text_generation' needs a prompt"):
        resolve_request(lm, Request(model="toy-lm", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text=prompt),)))


def test_prompt_upsampling_needs_a_card_with_a_reasoner() -> None:
    dit = toy_card("toy-dit")
    with pytest.raises(InvalidRequest, match=r"^prompt_upsampling: card 'toy-dit' has no reasoner"):
        resolve_request(dit, t2v(dit).with_updates(prompt_upsampling=True))
    omni = toy_card("toy-omni")
    assert resolve_request(omni, t2v(omni).with_updates(prompt_upsampling=True)).prompt_upsampling
