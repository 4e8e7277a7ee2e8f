"""The official Wan 2.2 14B LightX2V template, with tiny LoRA files, runs end to end on the tiny
A14B card: on ``fv serve``'s ComfyUI routes and with ``fv comfy run``'s runner. Each file lands on
its own expert (checked against the same request with the adapters registered by hand)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

import torch

from conftest import MODELS_FILE, load_api, retarget
from fv_kernel.api import AdapterRegistry, AdapterSettings, converter_for
from lora_files import comfy_lora

HIGH = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors"
LOW = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors"
CARD = "wan-tiny-a14b"
#: Adapters applied per row on every run (never merged into the weights), so two runs of one request
#: are bit-identical: merging rounds differently, and the engine picks it by measured cost.
PER_ROW = AdapterSettings(merge="never")


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("run_loras")
    comfy_lora(root / HIGH, seed=11, amplitude=1.0)
    comfy_lora(root / LOW, seed=12, amplitude=1.0)
    return root


def _template() -> dict[str, Any]:
    return retarget(load_api("wan22_14B_t2v_lightx2v_lora"))


def _engine(host: Any) -> tuple[Any, Any]:
    from fv_kernel.api import Engine, InstanceOptions, SchedulerConfig, build_instance
    from fv_wan.cards import wan_cards

    card = next(c for c in wan_cards() if c.model_id == CARD)
    instance = build_instance(card, InstanceOptions(registry=host.registry()))  # with fv-comfyui's samplers
    engine = Engine(SchedulerConfig(), adapters=AdapterRegistry(converter_for(card), PER_ROW))  # a deployment with adapters on
    engine.add_instance(instance)
    return engine, instance


def test_served_template_registers_each_file_for_its_expert_and_runs(host: Any, tmp_path: Path, lora_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from fv_kernel.api import DeployConfig, PluginsConfig
    from fv_comfyui.serving import mount
    from fv_comfyui.settings import LORAS_ENV, MODELS_ENV

    monkeypatch.delenv(MODELS_ENV, raising=False)
    monkeypatch.delenv(LORAS_ENV, raising=False)
    deploy = DeployConfig(output_dir=tmp_path, plugins=PluginsConfig(settings={"fv-comfyui": {
        "models": str(MODELS_FILE), "loras": str(lora_dir)}}))
    engine, instance = _engine(host)
    submitted: list[Any] = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request, **kw: submitted.append(request) or submit(request, **kw))

    @contextlib.asynccontextmanager
    async def running(_: FastAPI) -> AsyncIterator[None]:
        async with engine.running():
            yield

    app = FastAPI(lifespan=running)
    mount(app, engine, deploy)
    with TestClient(app) as client:
        names = client.get("/object_info/LoraLoaderModelOnly").json()["LoraLoaderModelOnly"]["input"]["required"]["lora_name"][0]
        assert names == [HIGH, LOW]
        response = client.post("/prompt", json={"prompt": _template()})
        assert response.status_code == 200 and response.json()["node_errors"] == {}, response.text
        prompt_id = response.json()["prompt_id"]
        for _ in range(600):
            history = client.get(f"/history/{prompt_id}").json()
            if history:
                break
            time.sleep(0.1)
        entry = history[prompt_id]
        assert entry["status"]["status_str"] == "success", entry["status"]
        assert set(entry["outputs"]) == {"80"}
    high = "comfy.wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise"
    low = "comfy.wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.transformer_2"
    (request,) = submitted
    assert [(a.name, a.scale) for a in request.adapters] == [(high, 1.0000000000000002), (low, 1.0000000000000002)]
    registry = instance.adapters
    assert {i.name: i.components for i in registry.list()} == {high: ("transformer",), low: ("transformer_2",)}
    assert registry.get(high).path == str((lora_dir / HIGH).resolve())


def _frames(engine: Any, request: Any) -> Any:
    from fv_kernel.api import run_blocking

    async def submit() -> Any:
        async with engine.running():
            return await engine.submit(request).result()

    result = run_blocking(submit())
    result.raise_for_status()
    return result.artifact("video").frames


def _copy_with_metadata(source: Path, target: Path, metadata: dict[str, str]) -> Path:
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(source)), str(target), metadata=metadata)
    return target


def test_each_file_lands_on_its_expert(host: Any, input_dir: Path, lora_dir: Path, tmp_path: Path) -> None:
    from fv_kernel.api import AdapterRef
    from fv_comfyui.models import ModelMap
    from fv_comfyui.service import service_for

    engine, instance = _engine(host)
    service = service_for(host, ModelMap.from_yaml(MODELS_FILE), input_dir, loras=lora_dir)
    (job,) = service.check(_template()).jobs
    compiled = _frames(engine, job.request(adapters=service.loras.register(instance.adapters, job.loras)))
    # The reference: the same files placed on the experts by hand, through fv-wan's metadata key
    # (not the adapter names fv-comfyui gives them), on the same request.
    registry = instance.adapters
    registry.add_file(_copy_with_metadata(lora_dir / HIGH, tmp_path / "ref_high.safetensors", {"fv_component": "transformer"}))
    registry.add_file(_copy_with_metadata(lora_dir / LOW, tmp_path / "ref_low.safetensors", {"fv_component": "transformer_2"}))
    scale = 1.0000000000000002
    by_hand = _frames(engine, job.request(adapters=(AdapterRef(name="ref_high", scale=scale),
                                                    AdapterRef(name="ref_low", scale=scale))))
    assert torch.equal(compiled, by_hand)
    base = _frames(engine, job.request())
    assert (base - by_hand).abs().max().item() > 1e-3  # the LoRAs change the video
    # Negative control: the files on the wrong experts give another video (a fresh engine: see
    # test_one_file_on_both_experts for why not the same registry).
    swapped_prompt = _template()
    swapped_prompt["83"]["inputs"]["lora_name"], swapped_prompt["85"]["inputs"]["lora_name"] = LOW, HIGH
    (swapped,) = service.check(swapped_prompt).jobs
    other_engine, other = _engine(host)
    wrong = _frames(other_engine, swapped.request(adapters=service.loras.register(other.adapters, swapped.loras)))
    assert (wrong - by_hand).abs().max().item() > 1e-3
    # Strengths 0: no adapter at all, the video without LoRA.
    zero_prompt = _template()
    zero_prompt["83"]["inputs"]["strength_model"] = zero_prompt["85"]["inputs"]["strength_model"] = 0.0
    (zero,) = service.check(zero_prompt).jobs
    assert zero.loras == () and torch.equal(_frames(engine, zero.request()), base)


def test_one_file_on_both_experts(host: Any, input_dir: Path, lora_dir: Path) -> None:
    """A style LoRA on both chains of the A14B template (the same file for both experts) runs, in one request."""
    from fv_comfyui.models import ModelMap
    from fv_comfyui.service import service_for

    engine, instance = _engine(host)
    service = service_for(host, ModelMap.from_yaml(MODELS_FILE), input_dir, loras=lora_dir)
    prompt = _template()
    prompt["85"]["inputs"]["lora_name"] = HIGH
    (job,) = service.check(prompt).jobs
    assert [u.components for u in job.loras] == [("transformer",), ("transformer_2",)]
    refs = service.loras.register(instance.adapters, job.loras)
    assert {instance.adapters.get(r.name).components for r in refs} == {("transformer",), ("transformer_2",)}
    assert _frames(engine, job.request(adapters=refs)).std() > 0.01


def test_the_runner_runs_a_lora_job_on_its_generators_engine(host: Any, input_dir: Path, lora_dir: Path,
                                                            tmp_path: Path) -> None:
    """``fv comfy run``'s path: ``fv.load`` and ``generate(..., loras=[{name, scale}])`` with fv-comfyui's adapters."""
    from fv_kernel.api import AdapterRef
    from fv_comfyui.models import ModelMap
    from fv_comfyui.run import JobRunner
    from fv_comfyui.service import service_for

    service = service_for(host, ModelMap.from_yaml(MODELS_FILE), input_dir, loras=lora_dir)
    (job,) = service.check(_template()).jobs
    from fv_kernel.api import DeployConfig

    runner = JobRunner(config=DeployConfig(adapters=PER_ROW), loras=service.loras)
    generator = runner.generator(CARD)
    events: list[Any] = []
    video = runner.run(job, on_event=events.append)
    steps = [(e.step, e.total) for e in events if getattr(e, "type", None) == "progress"
             and job.card.loops[e.loop_id].kind == "diffusion_denoise"]
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]
    registry = generator.instance.adapters
    registry.add_file(_copy_with_metadata(lora_dir / HIGH, tmp_path / "ref_high.safetensors", {"fv_component": "transformer"}))
    registry.add_file(_copy_with_metadata(lora_dir / LOW, tmp_path / "ref_low.safetensors", {"fv_component": "transformer_2"}))
    scale = 1.0000000000000002
    by_hand = _frames(generator.engine, job.request(adapters=(AdapterRef(name="ref_high", scale=scale),
                                                              AdapterRef(name="ref_low", scale=scale))))
    assert torch.equal(video.frames, by_hand)
    assert video.frames.shape == (5, 3, 32, 32)


def test_without_adapters_a_lora_workflow_is_refused_saying_how_to_turn_them_on(host: Any, tmp_path: Path, lora_dir: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from fv_comfyui.cli import comfy_app
    from fv_comfyui.models import ModelMap
    from fv_comfyui.service import service_for
    from fv_comfyui.settings import LORAS_ENV

    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from fv_kernel.api import DeployConfig, PluginsConfig
    from fv_comfyui.serving import mount
    from fv_comfyui.settings import MODELS_ENV

    # fv serve: refused at POST /prompt, on the LoRA node, before anything runs.
    monkeypatch.delenv(MODELS_ENV, raising=False)
    engine, instance = _engine(host)
    instance.adapters = None  # the deployment has no adapters: section
    app = FastAPI()
    mount(app, engine, DeployConfig(output_dir=tmp_path, plugins=PluginsConfig(settings={"fv-comfyui": {
        "models": str(MODELS_FILE), "loras": str(lora_dir)}})))
    response = TestClient(app).post("/prompt", json={"prompt": _template()})
    assert response.status_code == 400
    details = response.json()["node_errors"]["83"]["errors"][0]["details"]
    assert "adapters disabled" in details and "adapters: section" in details
    # Negative control: the same prompt on a card with adapters on is accepted (compiled, not run here).
    service = service_for(host, ModelMap.from_yaml(MODELS_FILE), tmp_path, loras=lora_dir)
    assert service.check(_template()).ok
    # fv comfy run with adapters turned off: refused before the card loads, ComfyUI's answer on stderr.
    monkeypatch.delenv(LORAS_ENV, raising=False)
    workflow = tmp_path / "template.json"
    workflow.write_text(json.dumps(_template()))
    off = tmp_path / "off.yaml"
    off.write_text("adapters:\n  enabled: false\n")
    result = CliRunner().invoke(comfy_app, ["run", str(workflow), "--config", str(off), "--comfy-models", str(MODELS_FILE),
                                            "--comfy-loras", str(lora_dir), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    answer = json.loads(result.output.strip().splitlines()[-1])
    assert "adapters disabled" in answer["node_errors"]["83"]["errors"][0]["details"]
    assert "Traceback" not in result.output
    # A runtime refusal (a card loaded without a registry) is one error line too.
    from fv_comfyui.loras import LoraFileError, adapter_registry

    with pytest.raises(LoraFileError, match="'wan-tiny-a14b' runs with adapters disabled"):
        adapter_registry(instance)
    # Negative control: without --comfy-loras the LoRA names are not in the (empty) folder list.
    refused = CliRunner().invoke(comfy_app, ["run", str(workflow), "--comfy-models", str(MODELS_FILE), "-o", str(tmp_path / "o")])
    assert refused.exit_code == 2 and "value_not_in_list" in refused.output


def test_lora_loader_strength_clip_changes_the_text_encoder(host: Any, input_dir: Path, tmp_path: Path) -> None:
    """A LoraLoader on the Wan 2.1 T2V fixture: model and text-encoder weights of one file at one strength."""
    from fv_kernel.api import AdapterRef, Engine, InstanceOptions, SchedulerConfig, build_instance
    from fv_comfyui.models import ModelMap
    from fv_comfyui.service import service_for
    from fv_wan.cards import wan_cards
    from lora_files import text_encoder_weights

    from conftest import load_pair

    folder = tmp_path / "loras"
    comfy_lora(folder / "both.safetensors", seed=21, amplitude=1.0, extra=text_encoder_weights(22))
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    instance = build_instance(card, InstanceOptions(registry=host.registry()))
    engine = Engine(SchedulerConfig(), adapters=AdapterRegistry(converter_for(card), PER_ROW))
    engine.add_instance(instance)
    service = service_for(host, ModelMap.from_yaml(MODELS_FILE), input_dir, loras=folder)

    def prompt(strength_model: float, strength_clip: float) -> dict[str, Any]:
        p = retarget(load_pair("text_to_video_wan")[1], steps=2)
        p["90"] = {"class_type": "LoraLoader", "inputs": {"model": ["37", 0], "clip": ["38", 0], "lora_name": "both.safetensors",
                                                      "strength_model": strength_model, "strength_clip": strength_clip}}
        p["48"]["inputs"]["model"] = ["90", 0]
        p["6"]["inputs"]["clip"] = p["7"]["inputs"]["clip"] = ["90", 1]
        return p

    (job,) = service.check(prompt(0.7, 0.7)).jobs
    assert [(u.components, u.scale) for u in job.loras] == [(("text_encoder", "transformer"), 0.7)]
    compiled = _frames(engine, job.request(adapters=service.loras.register(instance.adapters, job.loras)))
    instance.adapters.add_file(_copy_with_metadata(folder / "both.safetensors", tmp_path / "ref.safetensors", {"copy": "1"}))
    assert torch.equal(compiled, _frames(engine, job.request(adapters=(AdapterRef(name="ref", scale=0.7),))))
    # Negative control: the transformer part alone (the text-encoder weights dropped) is another video.
    from safetensors.torch import load_file, save_file

    model_only = {k: v for k, v in load_file(str(folder / "both.safetensors")).items() if not k.startswith("text_encoder.")}
    save_file(model_only, str(tmp_path / "model_part.safetensors"))
    instance.adapters.add_file(tmp_path / "model_part.safetensors")
    without_te = _frames(engine, job.request(adapters=(AdapterRef(name="model_part", scale=0.7),)))
    assert (without_te - compiled).abs().max().item() > 1e-4


def test_a_key_for_a_module_the_model_lacks_fails_the_run_naming_it(host: Any, input_dir: Path, tmp_path: Path) -> None:
    """Keys in a known layout that name no module of this model (a bigger model's block 7) pass the
    compile's conversion; the run fails at its first step, naming the entry, and runs nothing else."""
    from safetensors.torch import load_file, save_file

    from fv_kernel.api import StepFailed
    from fv_comfyui.models import ModelMap
    from fv_comfyui.service import service_for

    folder = tmp_path / "loras"
    comfy_lora(folder / HIGH, seed=31)
    tensors = load_file(str(comfy_lora(folder / LOW, seed=32)))
    tensors = {k.replace("blocks.1.", "blocks.7."): v for k, v in tensors.items()}
    save_file(tensors, str(folder / LOW))
    engine, instance = _engine(host)
    service = service_for(host, ModelMap.from_yaml(MODELS_FILE), input_dir, loras=folder)
    (job,) = service.check(_template()).jobs
    with pytest.raises(StepFailed, match=r"match no module of component 'transformer_2'.*blocks\.7\.attn1"):
        _frames(engine, job.request(adapters=service.loras.register(instance.adapters, job.loras)))


def test_fv_comfy_run_writes_the_templates_video_with_adapters_on(tmp_path: Path, lora_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from fv_comfyui.cli import comfy_app
    from fv_comfyui.settings import LORAS_ENV, MODELS_ENV

    monkeypatch.delenv(LORAS_ENV, raising=False)
    monkeypatch.delenv(MODELS_ENV, raising=False)
    workflow = tmp_path / "template.json"
    workflow.write_text(json.dumps(_template()))
    result = CliRunner().invoke(comfy_app, ["run", str(workflow), "--comfy-models", str(MODELS_FILE),
                                            "--comfy-loras", str(lora_dir), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path / 'out' / 'video' / 'ComfyUI_00001_.mp4'} (node 80)" in result.output


def test_the_template_runs_its_loras_on_fp8_experts(host: Any, input_dir: Path, lora_dir: Path) -> None:
    """The template's group with both UNETLoaders at ``fp8_e4m3fn`` (fv's ``fp8_weights``): each expert's
    LoRA applies per row to its e4m3 linears, and changes the video as it does at ``default``."""
    from fv_kernel.api import DeployConfig
    from fv_comfyui.models import ModelMap
    from fv_comfyui.run import JobRunner
    from fv_comfyui.service import service_for

    service = service_for(host, ModelMap.from_yaml(MODELS_FILE), input_dir, loras=lora_dir)
    runner = JobRunner(config=DeployConfig(adapters=PER_ROW), loras=service.loras)

    def video(weight_dtype: str, strength: float) -> Any:
        prompt = _template()
        for loader in ("75", "76"):
            prompt[loader]["inputs"]["weight_dtype"] = weight_dtype
        for lora in ("83", "85"):
            prompt[lora]["inputs"]["strength_model"] = strength
        (job,) = service.check(prompt).jobs
        return job, runner.run(job).frames

    job, fp8_adapted = video("fp8_e4m3fn", 1.0)
    assert job.precision_path == "fp8_weights" and job.loras
    assert runner.generator(CARD, "fp8_weights").instance.fp8_linear_components == {"transformer", "transformer_2"}
    _, fp8_plain = video("fp8_e4m3fn", 0.0)
    _, native_adapted = video("default", 1.0)
    _, native_plain = video("default", 0.0)
    moved, native_moved = (fp8_adapted - fp8_plain).abs().mean(), (native_adapted - native_plain).abs().mean()
    assert moved > 1e-3 and abs(moved - native_moved) < 0.25 * native_moved, (moved, native_moved)
