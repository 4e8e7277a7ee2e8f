"""Shared fixtures: the real ComfyUI workflow pairs (``shared/fixtures/comfyui``), copied into
``tests/fixtures`` so a clean clone's CI has them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
WORKFLOWS = ("text_to_video_wan", "image_to_video_wan_example", "text_to_video_wan22_14B")


def load_pair(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    ui = json.loads((FIXTURES / f"{name}.ui.json").read_text(encoding="utf-8"))
    api = json.loads((FIXTURES / f"{name}.api.json").read_text(encoding="utf-8"))
    return ui, api


@pytest.fixture
def t2v_pair() -> tuple[dict[str, Any], dict[str, Any]]:
    return copy.deepcopy(load_pair("text_to_video_wan"))
