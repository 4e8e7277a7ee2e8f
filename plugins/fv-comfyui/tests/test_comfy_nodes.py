"""The "fv Generate" custom-node pack against ComfyUI's custom-node interface.

ComfyUI itself is not on PyPI, so it cannot be installed here; the test does what ComfyUI's
``nodes.load_custom_node`` and ``execution`` do with a pack: import ``custom_nodes/<pack>/__init__.py``
as a module by file location, read ``NODE_CLASS_MAPPINGS`` / ``NODE_DISPLAY_NAME_MAPPINGS``,
read ``INPUT_TYPES()`` / ``RETURN_TYPES`` / ``FUNCTION`` / ``CATEGORY``, instantiate the class
and call ``getattr(obj, FUNCTION)(**inputs)``, expecting a tuple as long as ``RETURN_TYPES``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fv_comfyui.comfy_nodes import FvNodeError


def _load_like_comfyui(custom_nodes: Path, name: str) -> Any:
    path = custom_nodes / name / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    custom_nodes = tmp_path_factory.mktemp("custom_nodes")
    (custom_nodes / "fv_pack").mkdir()
    (custom_nodes / "fv_pack" / "__init__.py").write_text(
        "from fv_comfyui.comfy_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS\n"
    )
    module = _load_like_comfyui(custom_nodes, "fv_pack")
    yield module
    sys.modules.pop("fv_pack", None)


def test_the_pack_exposes_comfyuis_interface(pack: Any) -> None:
    assert pack.NODE_DISPLAY_NAME_MAPPINGS == {"FvGenerate": "fv Generate"}
    cls = pack.NODE_CLASS_MAPPINGS["FvGenerate"]
    types = cls.INPUT_TYPES()
    assert set(types) <= {"required", "optional", "hidden"}
    for section in types.values():
        for name, entry in section.items():
            assert isinstance(entry, tuple) and 1 <= len(entry) <= 2, name
            assert isinstance(entry[0], (str, list)) and (len(entry) == 1 or isinstance(entry[1], dict)), name
    assert types["required"]["seed"][1]["control_after_generate"] is True
    assert cls.RETURN_TYPES == ("IMAGE",) and len(cls.RETURN_NAMES) == len(cls.RETURN_TYPES)
    assert callable(getattr(cls(), cls.FUNCTION)) and isinstance(cls.CATEGORY, str)


def _defaults(cls: Any) -> dict[str, Any]:
    return {name: entry[1]["default"] for name, entry in cls.INPUT_TYPES()["required"].items()}


def test_executed_as_comfyui_does_it_returns_fv_generates_frames(pack: Any) -> None:
    from fv_kernel.api import load

    cls = pack.NODE_CLASS_MAPPINGS["FvGenerate"]
    inputs = {**_defaults(cls), "prompt": "a red fox", "seed": 3, "width": 32, "height": 32, "frames": 5, "steps": 2}
    out = getattr(cls(), cls.FUNCTION)(**inputs)
    assert isinstance(out, tuple) and len(out) == len(cls.RETURN_TYPES)
    (frames,) = out
    assert frames.shape == (5, 32, 32, 3) and frames.dtype == torch.float32  # ComfyUI's IMAGE: (B, H, W, C)
    expected = load("wan-tiny").generate("a red fox", seed=3, width=32, height=32, frames=5, steps=2).frames
    assert torch.equal(frames, expected.permute(0, 2, 3, 1))


def test_an_image_input_runs_image_to_video(pack: Any) -> None:
    cls = pack.NODE_CLASS_MAPPINGS["FvGenerate"]
    image = torch.rand(1, 40, 40, 3, generator=torch.Generator().manual_seed(0))  # a ComfyUI IMAGE
    inputs = {**_defaults(cls), "prompt": "a fox", "model": "wan-tiny-i2v", "width": 32, "height": 32, "frames": 5, "steps": 2}
    (frames,) = cls().generate(**inputs, image=image)
    assert frames.shape == (5, 32, 32, 3)


def test_errors_are_one_message(pack: Any) -> None:
    cls = pack.NODE_CLASS_MAPPINGS["FvGenerate"]
    with pytest.raises(FvNodeError, match="no-such-card"):
        cls().generate(**{**_defaults(cls), "prompt": "x", "model": "no-such-card"})
    with pytest.raises(FvNodeError, match="cannot reach fv serve"):
        cls().generate(**{**_defaults(cls), "prompt": "x"}, server_url="http://127.0.0.1:9")
    with pytest.raises(FvNodeError, match="expected a ComfyUI IMAGE"):
        cls().generate(**{**_defaults(cls), "prompt": "x"}, image=torch.zeros(3, 8, 8))
