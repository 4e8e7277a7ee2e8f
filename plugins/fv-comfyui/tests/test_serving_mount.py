"""Mounting the ComfyUI routes: the mapping file from the deploy config's plugins.settings or FV_COMFY_MODELS
(which overrides it), the LoRA folder likewise (loras / FV_COMFY_LORAS), a malformed setting, and what
happens without either."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from conftest import MODELS_FILE  # noqa: E402
from fv_kernel.api import DeployConfig, Engine, PluginsConfig  # noqa: E402
from fv_comfyui.models import ComfyModelsError  # noqa: E402
from fv_comfyui.serving import mount  # noqa: E402
from fv_comfyui.settings import LORAS_ENV, MODELS_ENV, ComfySettingsError, loras_folder, models_file  # noqa: E402


def test_models_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODELS_ENV, str(MODELS_FILE))
    app = FastAPI()
    mount(app, Engine(), DeployConfig(output_dir=tmp_path))
    info = TestClient(app).get("/object_info/UNETLoader").json()
    assert "wan2.1_t2v_1.3B_fp16.safetensors" in info["UNETLoader"]["input"]["required"]["unet_name"][0]


def _recorded(action: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught]


def test_without_a_mapping_the_server_starts_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fv serve`` mounts these routes at startup: no mapping was asked for, so nothing to warn about yet."""
    monkeypatch.delenv(MODELS_ENV, raising=False)
    assert _recorded(lambda: mount(FastAPI(), Engine(), DeployConfig(output_dir=tmp_path))) == []


@pytest.mark.parametrize("route", ["object_info", "prompt"])
def test_without_a_mapping_a_comfyui_route_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str,
) -> None:
    monkeypatch.delenv(MODELS_ENV, raising=False)
    app = FastAPI()
    mount(app, Engine(), DeployConfig(output_dir=tmp_path))
    client = TestClient(app)

    def use() -> Any:
        if route == "object_info":
            return client.get("/object_info/UNETLoader").json()
        return client.post("/prompt", json={"prompt": {}})

    with pytest.warns(UserWarning, match="no model mapping file .*plugins.settings.fv-comfyui.models.*FV_COMFY_MODELS"):
        answer = use()
    if route == "object_info":
        assert answer["UNETLoader"]["input"]["required"]["unet_name"][0] == []
    assert _recorded(use) == []  # once per server, not per request


def test_with_a_mapping_no_route_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODELS_ENV, str(MODELS_FILE))
    app = FastAPI()
    mount(app, Engine(), DeployConfig(output_dir=tmp_path))
    assert _recorded(lambda: TestClient(app).get("/object_info/UNETLoader")) == []


def test_a_bad_mapping_file_raises_for_the_kernel_to_contain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODELS_ENV, str(tmp_path / "absent.yaml"))
    with pytest.raises(ComfyModelsError, match="cannot read it"):
        mount(FastAPI(), Engine(), DeployConfig(output_dir=tmp_path))


def _deploy(tmp_path: Path, settings: dict) -> DeployConfig:
    return DeployConfig(output_dir=tmp_path, plugins=PluginsConfig(settings={"fv-comfyui": settings}))


def _unet_names(app: FastAPI) -> list[str]:
    return TestClient(app).get("/object_info/UNETLoader").json()["UNETLoader"]["input"]["required"]["unet_name"][0]


def test_models_come_from_the_deploy_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MODELS_ENV, raising=False)
    app = FastAPI()
    mount(app, Engine(), _deploy(tmp_path, {"models": str(MODELS_FILE)}))
    assert "wan2.1_t2v_1.3B_fp16.safetensors" in _unet_names(app)


def test_the_environment_overrides_the_deploy_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODELS_ENV, str(MODELS_FILE))
    config = _deploy(tmp_path, {"models": str(tmp_path / "absent.yaml")})
    assert models_file(config) == MODELS_FILE
    app = FastAPI()
    mount(app, Engine(), config)
    assert "wan2.1_t2v_1.3B_fp16.safetensors" in _unet_names(app)
    # Negative control: without the variable the config's (absent) file is the one read.
    monkeypatch.delenv(MODELS_ENV)
    with pytest.raises(ComfyModelsError, match="absent.yaml"):
        mount(FastAPI(), Engine(), config)


@pytest.mark.parametrize(("settings", "needle"), [
    ({"model": "m.yaml"}, "plugins.settings.fv-comfyui.model: Extra inputs are not permitted (allowed keys: models, loras, diffusion_models, previews)"),
    ({"models": 3}, "plugins.settings.fv-comfyui.models:"),
])
def test_a_malformed_setting_names_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: dict, needle: str) -> None:
    monkeypatch.delenv(MODELS_ENV, raising=False)
    with pytest.raises(ComfySettingsError) as caught:
        mount(FastAPI(), Engine(), _deploy(tmp_path, settings))
    assert needle in str(caught.value)


def _lora_names(app: FastAPI) -> list[str]:
    info = TestClient(app).get("/object_info/LoraLoaderModelOnly").json()
    return info["LoraLoaderModelOnly"]["input"]["required"]["lora_name"][0]


def test_the_lora_folder_comes_from_the_deploy_config_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODELS_ENV, str(MODELS_FILE))
    monkeypatch.delenv(LORAS_ENV, raising=False)
    configured, environment = tmp_path / "configured", tmp_path / "environment"
    for folder, name in ((configured, "a.safetensors"), (environment, "sub/b.safetensors")):
        (folder / name).parent.mkdir(parents=True)
        (folder / name).write_bytes(b"")
    config = _deploy(tmp_path, {"loras": str(configured)})
    assert loras_folder(config) == configured
    app = FastAPI()
    mount(app, Engine(), config)
    assert _lora_names(app) == ["a.safetensors"]
    (configured / "new.safetensors").write_bytes(b"")  # listed as the folder is now, as ComfyUI lists it
    assert _lora_names(app) == ["a.safetensors", "new.safetensors"]
    monkeypatch.setenv(LORAS_ENV, str(environment))  # the variable overrides the config
    assert loras_folder(config) == environment
    app = FastAPI()
    mount(app, Engine(), config)
    assert _lora_names(app) == ["sub/b.safetensors"]
    monkeypatch.delenv(LORAS_ENV)
    assert loras_folder(_deploy(tmp_path, {})) is None
    app = FastAPI()
    mount(app, Engine(), _deploy(tmp_path, {}))
    assert _lora_names(app) == []
