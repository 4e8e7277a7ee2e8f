"""ComfyUI's ``models/diffusion_models`` folder: a UNETLoader's file loads as the diffusion model its
mapping names (``WeightFiles``; docs/comfyui.md, "Model files").

The files are written here as ComfyUI's fp8 converters write them (e4m3 weights, a per-tensor
``scale_weight``, the ``scaled_fp8`` marker), from the tiny cards' own weights scaled by 1.1, so a
run on the card's seeded weights is a different video."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from conftest import load_api, retarget
from fv_kernel.api import load
from fv_comfyui.compile import WeightFiles
from fv_comfyui.models import ModelMap, ModelTarget
from fv_comfyui.run import JobRunner
from test_equivalence import one_thread  # noqa: F401 - both sides on one thread

A14B = "wan22_14B_t2v_fp8"  # UNETLoader #37 (high noise -> transformer), #56 (low noise -> transformer_2)
HIGH, LOW = "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"
LINEAR = re.compile(r"blocks\.\d+\.(attn[12]\.to_(q|k|v|out\.0)|ffn\.net\.(0\.proj|2))\.weight")


def _write_fp8_scaled(model: torch.nn.Module, path: Path) -> None:
    """``model``'s weights x 1.1, its block linears in e4m3 with a per-tensor scale (ComfyUI's legacy layout)."""
    tensors: dict[str, torch.Tensor] = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, value in model.state_dict().items():
        if key.startswith("rope."):
            continue
        value = value.float() * 1.1
        if LINEAR.fullmatch(key):
            scale = value.abs().max() / 448.0
            tensors[key] = (value / scale).to(torch.float8_e4m3fn)
            tensors[key[: -len("weight")] + "scale_weight"] = scale.reshape(1)
        else:
            tensors[key] = value.contiguous()
    save_file(tensors, str(path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A diffusion_models folder holding the A14B template's two files, for wan-tiny-a14b."""
    root = tmp_path_factory.mktemp("diffusion_models")
    instance = load("wan-tiny-a14b").instance
    _write_fp8_scaled(instance.component("transformer"), root / HIGH)
    _write_fp8_scaled(instance.component("transformer_2"), root / LOW)
    return root


def _prompt(dtype: str = "fp8_e4m3fn") -> dict[str, Any]:
    prompt = retarget(load_api(A14B), steps=2)
    for loader in ("37", "56"):
        prompt[loader]["inputs"]["weight_dtype"] = dtype
    return prompt


def _details(answer: Any, node: str) -> str:
    assert not answer.ok, answer.body()
    (error,) = answer.node_errors[node]["errors"]
    assert error["extra_info"] == {"input_name": "unet_name"}
    return str(error["details"])


def test_each_unetloader_file_becomes_its_experts_source(service: Any, folder: Path) -> None:
    with_folder = dataclasses.replace(service, weight_files=WeightFiles(diffusion_models=folder))
    (job,) = with_folder.check(_prompt()).jobs
    assert job.component_sources == {"transformer": folder / HIGH, "transformer_2": folder / LOW}
    assert job.fv_generate_args("wan-tiny-a14b")[-4:] == [
        "--component-source", f"transformer={folder / HIGH}", "--component-source", f"transformer_2={folder / LOW}"]
    (plain,) = service.check(_prompt()).jobs  # no folder: the names stand for the card's own weights
    assert plain.component_sources == {}


@pytest.mark.usefixtures("one_thread")
def test_the_workflow_runs_the_files_weights_as_fv_load_does(service: Any, folder: Path) -> None:
    """End to end: the workflow's frames are bit for bit ``fv.load(card, component_sources=...)``'s."""
    with_folder = dataclasses.replace(service, weight_files=WeightFiles(diffusion_models=folder))
    (job,) = with_folder.check(_prompt()).jobs
    runner = JobRunner()
    video = runner.run(job)
    reference = load("wan-tiny-a14b", precision_path="fp8_weights",
                     component_sources={"transformer": folder / HIGH, "transformer_2": folder / LOW})
    layer = reference.instance.component("transformer").blocks[0].attn1.to_q
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dim() == 0  # the file's per-tensor scale
    assert torch.equal(video.frames, reference.generate(job.prompt, **job.options).frames)
    # Negative control: the same workflow without the folder runs the card's seeded weights, and differs.
    (plain,) = service.check(_prompt()).jobs
    assert not torch.equal(runner.run(plain).frames, video.frames)


def test_a_name_missing_from_the_folder_is_refused(service: Any, folder: Path, tmp_path: Path) -> None:
    (tmp_path / HIGH).write_bytes((folder / HIGH).read_bytes())  # only the first stage's file
    answer = dataclasses.replace(service, weight_files=WeightFiles(diffusion_models=tmp_path)).check(_prompt())
    assert _details(answer, "56") == (f"unet_name - fv: {LOW!r} is not a file in the diffusion_models folder "
                                      f"{str(tmp_path)!r}")


def test_fv_serve_runs_only_the_files_it_serves(service: Any, folder: Path) -> None:
    """A server loads its weights at start-up: a workflow naming another file than a served component's is
    refused, and so is a file in the folder for a component served from the card's checkpoint."""
    served = {"wan-tiny-a14b": {"transformer": folder / HIGH, "transformer_2": folder / LOW}}
    fp16 = "wan2.2_t2v_high_noise_14B_fp16.safetensors"  # another file of the first expert
    models = ModelMap({**service.models.entries, fp16: (ModelTarget("wan-tiny-a14b", "transformer"),)})
    serving = dataclasses.replace(service, models=models, weight_files=WeightFiles(served=served))
    (job,) = serving.check(_prompt()).jobs
    assert job.component_sources == {}  # the served instance's own
    other = _prompt()
    other["37"]["inputs"]["unet_name"] = fp16
    assert _details(serving.check(other), "37") == (
        f"unet_name - fv: this server serves card 'wan-tiny-a14b''s transformer from {HIGH!r} (the deploy config's "
        f"cards[].component_sources), not {fp16!r}; unet_name may be {HIGH!r}")
    from_checkpoint = dataclasses.replace(service, weight_files=WeightFiles(diffusion_models=folder,
                                                                            served={"wan-tiny-a14b": {}}))
    assert "this server serves card 'wan-tiny-a14b''s transformer from the card's checkpoint; serve the file with the " \
           "deploy config's cards[].component_sources.transformer" in _details(from_checkpoint.check(_prompt()), "37")


def test_the_setting_and_the_environment_name_the_folder(tmp_path: Path) -> None:
    from fv_kernel.api import DeployConfig, PluginsConfig
    from fv_comfyui.settings import DIFFUSION_MODELS_ENV, ComfySettingsError, comfy_settings, diffusion_models_folder

    config = DeployConfig(plugins=PluginsConfig(settings={"fv-comfyui": {"diffusion_models": str(tmp_path)}}))
    assert diffusion_models_folder(config, {}) == tmp_path
    assert diffusion_models_folder(config, {DIFFUSION_MODELS_ENV: "/elsewhere"}) == Path("/elsewhere")
    assert diffusion_models_folder(DeployConfig(), {}) is None
    with pytest.raises(ComfySettingsError, match="diffusion_model.*allowed keys: .*diffusion_models"):
        comfy_settings(DeployConfig(plugins=PluginsConfig(settings={"fv-comfyui": {"diffusion_model": "x"}})))


def test_fv_comfy_run_refuses_a_folder_that_is_not_one(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from conftest import FIXTURES, MODELS_FILE
    from fv_comfyui.cli import comfy_app

    result = CliRunner().invoke(comfy_app, ["run", str(FIXTURES / f"{A14B}.api.json"), "--comfy-models", str(MODELS_FILE),
                                            "--comfy-diffusion-models", str(tmp_path / "nope"), "-o", str(tmp_path)])
    assert result.exit_code == 2
    assert f"diffusion_models: {str(tmp_path / 'nope')!r} is not a folder" in result.output


def test_fv_serve_checks_workflows_against_its_instances_files(service: Any, host: Any, folder: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from conftest import MODELS_FILE
    from fv_kernel.api import DeployConfig, Engine, InstanceOptions, PluginsConfig, build_instance
    from fv_comfyui.serving import mount
    from fv_comfyui.settings import DIFFUSION_MODELS_ENV, MODELS_ENV

    monkeypatch.delenv(MODELS_ENV, raising=False)
    monkeypatch.delenv(DIFFUSION_MODELS_ENV, raising=False)
    engine = Engine()
    sources = {"transformer": folder / HIGH, "transformer_2": folder / LOW}
    engine.add_instance(build_instance(service.cards["wan-tiny-a14b"], InstanceOptions(
        precision_path="fp8_weights", component_sources=sources, registry=host.registry())))
    app = FastAPI()
    fp16 = "wan2.2_t2v_low_noise_14B_fp16.safetensors"  # another file of the second expert
    models = tmp_path / "models.yaml"
    models.write_text(MODELS_FILE.read_text() + f"{fp16}: wan-tiny-a14b:transformer_2\n")
    settings = {"models": str(models), "diffusion_models": str(folder)}
    server = mount(app, engine, DeployConfig(output_dir=tmp_path, plugins=PluginsConfig(settings={"fv-comfyui": settings})))
    assert server.service.weight_files == WeightFiles(diffusion_models=folder, served={"wan-tiny-a14b": sources})
    client = TestClient(app)
    other = _prompt()
    other["56"]["inputs"]["unet_name"] = fp16
    reply = client.post("/prompt", json={"prompt": other})
    assert reply.status_code == 400
    (error,) = reply.json()["node_errors"]["56"]["errors"]
    assert error["details"].startswith(f"unet_name - fv: this server serves card 'wan-tiny-a14b''s transformer_2 from {LOW!r}")


def test_a_name_leading_outside_the_folder_is_refused(service: Any, folder: Path, tmp_path: Path) -> None:
    """A ``unet_name`` with ``..`` never reaches a file beside the folder, even one that exists."""
    (tmp_path / "models").mkdir()
    (tmp_path / HIGH).write_bytes((folder / HIGH).read_bytes())  # beside the folder, not in it
    escape = f"../{HIGH}"
    models = ModelMap({**service.models.entries, escape: (ModelTarget("wan-tiny-a14b", "transformer"),)})
    prompt = _prompt()
    prompt["37"]["inputs"]["unet_name"] = escape
    answer = dataclasses.replace(service, models=models,
                                 weight_files=WeightFiles(diffusion_models=tmp_path / "models")).check(prompt)
    assert _details(answer, "37") == (f"unet_name - fv: {escape!r} is not a file in the diffusion_models folder "
                                      f"{str(tmp_path / 'models')!r}")
