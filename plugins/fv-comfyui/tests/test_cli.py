"""``fv comfy run`` / ``fv comfy convert``: the real command (as its own process) on a saved UI
workflow, and its one-line refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from conftest import MODELS_FILE, load_pair, write_image
from fv_comfyui.cli import comfy_app

runner = CliRunner()


def _tiny_ui(name: str) -> dict[str, Any]:
    """The fixture's UI workflow with the tiny cards' sizes and 2 steps (its own sampler, uni_pc)."""
    ui, _ = load_pair(name)
    for node in ui["nodes"]:
        values = node.get("widgets_values")
        if node["type"] in ("EmptyHunyuanLatentVideo", "WanImageToVideo"):
            values[:3] = [32, 32, 5]
        elif node["type"] == "KSampler":
            values[2] = 2
    return ui


def _fv(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = "import sys; from fv_kernel.cli.app import main; sys.argv = ['fv', *sys.argv[1:]]; main()"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FV_PLUGINS", None)
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def test_fv_comfy_run_writes_the_save_nodes_files(tmp_path: Path) -> None:
    workflow = tmp_path / "image_to_video.json"
    workflow.write_text(json.dumps(_tiny_ui("image_to_video_wan_example")))
    write_image(tmp_path / "flux_dev_example.png", 40, 40)  # LoadImage reads the workflow's folder by default
    done = _fv("comfy", "run", str(workflow), "--comfy-models", str(MODELS_FILE), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {tmp_path / 'out' / 'ComfyUI_00001_.webp'} (node 28)"
    # Progress on stderr: one line per sampler step, naming the node.
    assert [line for line in done.stderr.splitlines() if line.startswith("progress:")] == [
        "progress: node 3 (KSampler) step 1/2", "progress: node 3 (KSampler) step 2/2"]
    from PIL import Image

    with Image.open(tmp_path / "out" / "ComfyUI_00001_.webp") as webp:
        assert webp.n_frames == 5 and webp.size == (32, 32)


def test_a_refused_prompt_prints_comfyuis_answer(tmp_path: Path) -> None:
    _, api = load_pair("text_to_video_wan")
    api["3"]["inputs"]["sampler_name"] = "dpmpp_2m"  # a sampler fv does not map
    path = tmp_path / "api.json"
    path.write_text(json.dumps({"prompt": api, "client_id": "x"}))  # a saved POST /prompt body works too
    result = runner.invoke(comfy_app, ["run", str(path), "--comfy-models", str(MODELS_FILE), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2
    body = json.loads(result.stderr.strip().splitlines()[-1])
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["3"]["errors"][0]["type"] == "value_not_in_list"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("setup", "message"), [
    (lambda p: p.write_text("{not json"), "is not JSON"),
    (lambda p: None, "cannot read"),
])
def test_unreadable_workflows_are_one_line(tmp_path: Path, setup: Any, message: str) -> None:
    path = tmp_path / "w.json"
    setup(path)
    result = runner.invoke(comfy_app, ["run", str(path), "--comfy-models", str(MODELS_FILE)])
    assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_a_bad_mapping_file_is_one_line(tmp_path: Path) -> None:
    workflow = tmp_path / "w.json"
    workflow.write_text(json.dumps(load_pair("text_to_video_wan")[1]))
    models = tmp_path / "m.yaml"
    models.write_text("a.safetensors: not-a-card\n")
    result = runner.invoke(comfy_app, ["run", str(workflow), "--comfy-models", str(models)])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: comfy models: 'a.safetensors' maps to card 'not-a-card', which is not installed; " \
        "installed: " + result.stderr.strip().split("installed: ")[1]


def test_convert_prints_the_api_prompt(tmp_path: Path) -> None:
    ui, api = load_pair("text_to_video_wan22_14B")
    path = tmp_path / "ui.json"
    path.write_text(json.dumps(ui))
    result = runner.invoke(comfy_app, ["convert", str(path)])
    assert result.exit_code == 0 and json.loads(result.stdout) == api
    path.write_text(json.dumps(api))
    refused = runner.invoke(comfy_app, ["convert", str(path)])
    assert refused.exit_code == 2 and "not a UI workflow" in refused.stderr


def test_fv_help_lists_comfy_from_the_manifest(tmp_path: Path) -> None:
    done = _fv("--help", cwd=tmp_path)
    assert "comfy" in done.stdout and "Run ComfyUI workflows on fv." in done.stdout


def test_a_partly_valid_prompt_runs_the_valid_outputs_and_says_what_it_skips(tmp_path: Path) -> None:
    from conftest import retarget

    prompt = retarget(load_pair("text_to_video_wan")[1], steps=2)
    prompt["47"] = {"class_type": "SaveWEBM", "inputs": {"filename_prefix": "x", "codec": "vp9", "fps": 24.0, "crf": 99.0,
                                                         "images": ["8", 0]}}
    path = tmp_path / "api.json"
    path.write_text(json.dumps(prompt))
    result = runner.invoke(comfy_app, ["run", str(path), "--comfy-models", str(MODELS_FILE), "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    warning, *progress = result.stderr.strip().splitlines()
    assert warning == "warning: node 47 (SaveWEBM): Value 99.0 bigger than max of 63.0: crf; skipping output(s) 47"
    assert progress == ["progress: node 3 (KSampler) step 1/2", "progress: node 3 (KSampler) step 2/2"]
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["ComfyUI_00001_.webp"]  # 47 wrote nothing


def _deploy_with_models(tmp_path: Path, settings: str) -> Path:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"plugins:\n  settings:\n    fv-comfyui: {settings}\n")
    return deploy


def test_run_takes_the_mapping_file_from_the_deploy_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FV_COMFY_MODELS", raising=False)
    monkeypatch.delenv("FV_PLUGINS", raising=False)
    workflow = tmp_path / "t2v.json"
    workflow.write_text(json.dumps(_tiny_ui("text_to_video_wan")))
    deploy = _deploy_with_models(tmp_path, f"{{models: {json.dumps(str(MODELS_FILE))}}}")
    result = runner.invoke(comfy_app, ["run", str(workflow), "--config", str(deploy), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"wrote {tmp_path / 'out' / 'ComfyUI_00001_.webp'} (node 28)"


def test_without_a_mapping_file_it_says_where_to_give_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FV_COMFY_MODELS", raising=False)
    workflow = tmp_path / "t2v.json"
    workflow.write_text(json.dumps(_tiny_ui("text_to_video_wan")))
    result = runner.invoke(comfy_app, ["run", str(workflow), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: no model mapping file: pass --comfy-models FILE, set FV_COMFY_MODELS, or set "
                                     "plugins.settings.fv-comfyui.models in the deploy config (--config)")
    bad = _deploy_with_models(tmp_path, "{modles: m.yaml}")
    result = runner.invoke(comfy_app, ["run", str(workflow), "--config", str(bad), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "plugins.settings.fv-comfyui.modles: Extra inputs are not permitted (allowed keys: models, loras, diffusion_models, previews)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_progress_lines_per_step_and_the_same_frames(service: Any) -> None:
    from conftest import retarget
    from fv_comfyui.cli import _progress_printer
    from fv_comfyui.run import JobRunner

    prompt = retarget(load_pair("text_to_video_wan22_14B")[1])  # two stages: the second sampler node is named
    answer = service.check(prompt)
    (job,) = answer.jobs
    runner = JobRunner()
    lines: list[str] = []
    import typer

    original = typer.echo
    try:
        typer.echo = lambda message, err=False: lines.append(f"{'err' if err else 'out'}: {message}")  # type: ignore[assignment]
        streamed = runner.run(job, on_event=_progress_printer(job, answer.prompt))
    finally:
        typer.echo = original  # type: ignore[assignment]
    assert lines == [f"err: progress: node 58 (KSamplerAdvanced) step {k}/4" for k in (1, 2, 3, 4)]
    assert torch.equal(streamed.frames, runner.run(job).frames)  # the streamed run is the same run
