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
#: API prompts written from ComfyUI's node definitions (fixtures/SOURCES.md), no UI pair.
TEMPLATES = ("wan22_ti2v_5B_i2v", "wan22_ti2v_5B_t2v", "wan22_14B_t2v_fp8")


def load_api(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.api.json").read_text(encoding="utf-8"))


def load_pair(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    ui = json.loads((FIXTURES / f"{name}.ui.json").read_text(encoding="utf-8"))
    api = json.loads((FIXTURES / f"{name}.api.json").read_text(encoding="utf-8"))
    return ui, api


@pytest.fixture
def t2v_pair() -> tuple[dict[str, Any], dict[str, Any]]:
    return copy.deepcopy(load_pair("text_to_video_wan"))


MODELS_FILE = FIXTURES / "tiny-models.yaml"


def write_image(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """A small deterministic RGB PNG."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="session")
def input_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("comfy_input")
    write_image(folder / "flux_dev_example.png", 48, 48)
    write_image(folder / "wide.png", 64, 32, seed=1)
    write_image(folder / "example.png", 40, 40, seed=2)  # the TI2V template's LoadImage
    return folder


@pytest.fixture(scope="session")
def host() -> Any:
    from fv_kernel.api import PluginHost

    plugin_host = PluginHost()
    plugin_host.start()
    return plugin_host


@pytest.fixture(scope="session")
def service(host: Any, input_dir: Path) -> Any:
    from fv_comfyui.models import ModelMap
    from fv_comfyui.service import service_for

    return service_for(host, ModelMap.from_yaml(MODELS_FILE), input_dir)


def retarget(prompt: dict[str, Any], *, size: int = 32, length: int = 5, steps: int = 3) -> dict[str, Any]:
    """A fixture prompt shrunk to the tiny cards' limits; its own sampler and scheduler are kept."""
    prompt = copy.deepcopy(prompt)
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] in ("EmptyHunyuanLatentVideo", "WanImageToVideo", "Wan22ImageToVideoLatent"):
            inputs.update(width=size, height=size, length=length)
        if node["class_type"] == "KSampler":
            inputs.update(steps=steps)
        if node["class_type"] == "KSamplerAdvanced":
            inputs.update(steps=steps + 1)
            if inputs["add_noise"] == "enable":
                inputs["end_at_step"] = 2
            else:
                inputs["start_at_step"] = 2
    return prompt
