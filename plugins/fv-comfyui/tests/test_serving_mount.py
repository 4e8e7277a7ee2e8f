"""Mounting the ComfyUI routes: the mapping file from FV_COMFY_MODELS, and what happens without it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from conftest import MODELS_FILE  # noqa: E402
from fv_kernel.api import DeployConfig, Engine  # noqa: E402
from fv_comfyui.models import ComfyModelsError  # noqa: E402
from fv_comfyui.serving import MODELS_ENV, mount  # noqa: E402


def test_models_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODELS_ENV, str(MODELS_FILE))
    app = FastAPI()
    mount(app, Engine(), DeployConfig(output_dir=tmp_path))
    info = TestClient(app).get("/object_info/UNETLoader").json()
    assert "wan2.1_t2v_1.3B_fp16.safetensors" in info["UNETLoader"]["input"]["required"]["unet_name"][0]


def test_without_the_variable_every_loader_is_empty_and_it_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODELS_ENV, raising=False)
    app = FastAPI()
    with pytest.warns(UserWarning, match="FV_COMFY_MODELS is not set"):
        mount(app, Engine(), DeployConfig(output_dir=tmp_path))
    info = TestClient(app).get("/object_info/UNETLoader").json()
    assert info["UNETLoader"]["input"]["required"]["unet_name"][0] == []


def test_a_bad_mapping_file_raises_for_the_kernel_to_contain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODELS_ENV, str(tmp_path / "absent.yaml"))
    with pytest.raises(ComfyModelsError, match="cannot read it"):
        mount(FastAPI(), Engine(), DeployConfig(output_dir=tmp_path))
