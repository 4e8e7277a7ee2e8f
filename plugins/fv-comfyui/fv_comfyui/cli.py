"""``fv comfy``: run a ComfyUI workflow (UI or API format) on fv, or convert one.

Declared in the plugin's manifest (``commands: comfy``), so ``fv --help`` lists it without
importing this module. ``run`` prints one ``progress: node ID (CLASS) step K/N`` line on stderr per
sampler step and one ``wrote PATH (node ID)`` line on stdout per file. Every problem is one line
on stderr and exit status 2, except a prompt
ComfyUI's rules refuse: that prints ComfyUI's own answer (``{"error", "node_errors"}``, one
JSON line on stderr) and exits 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer

__all__ = ["comfy_app"]

comfy_app = typer.Typer(
    name="comfy", help="Run ComfyUI workflows on fv.", no_args_is_help=True, add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

ModelsOption = typer.Option(
    None, "--comfy-models",
    help="YAML mapping ComfyUI model file names to card ids ('card', 'card:component' or a list). Default: "
         "FV_COMFY_MODELS, else the deploy config's plugins.settings.fv-comfyui.models.",
)


LorasOption = typer.Option(
    None, "--comfy-loras",
    help="ComfyUI's models/loras folder: the files LoraLoader / LoraLoaderModelOnly's lora_name names. Default: "
         "FV_COMFY_LORAS, else the deploy config's plugins.settings.fv-comfyui.loras.",
)


DiffusionModelsOption = typer.Option(
    None, "--comfy-diffusion-models",
    help="ComfyUI's models/diffusion_models folder: a UNETLoader's unet_name file loads from it as the diffusion "
         "model its mapping names (an fp8_scaled file runs its own weights and scales). Default: "
         "FV_COMFY_DIFFUSION_MODELS, else the deploy config's plugins.settings.fv-comfyui.diffusion_models; unset: "
         "mapped names run the cards' own weights.",
)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _read_document(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        _fail(f"workflow: cannot read {str(path)!r}: {exc.strerror or exc}")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        _fail(f"workflow: {str(path)!r} is not JSON: {exc}")
    if isinstance(document, dict) and isinstance(document.get("prompt"), dict) and "nodes" not in document:
        return document["prompt"]  # a saved POST /prompt body
    return document


def _progress_printer(job: Any, prompt: dict[str, Any]) -> Any:
    """Per sampler step, one ``progress:`` line on stderr naming the node (stdout keeps the ``wrote`` lines)."""
    node = job.sampler_node
    label = f"node {node} ({prompt[node]['class_type']})" if node in prompt else f"node {node}"

    def on_event(event: Any) -> None:
        if getattr(event, "type", None) != "progress" or not event.total:
            return
        spec = job.card.loops.get(event.loop_id)
        if spec is not None and spec.kind == "diffusion_denoise":
            typer.echo(f"progress: {label} step {event.step}/{event.total}", err=True)

    return on_event


@comfy_app.command("convert")
def convert(
    workflow: Path = typer.Argument(..., help="A UI workflow (the editor's saved .json)."),
    image_dir: Optional[Path] = typer.Option(None, "--image-dir", help="ComfyUI's input folder: adds LoadImage's is_changed."),
) -> None:
    """Print the API prompt ComfyUI makes of a UI workflow."""
    from fv_comfyui.convert import WorkflowFormatError, is_ui_workflow, ui_to_api

    document = _read_document(workflow)
    if not is_ui_workflow(document):
        _fail("workflow: not a UI workflow (no 'nodes' and 'links'); an API prompt needs no conversion")
    try:
        typer.echo(json.dumps(ui_to_api(document, image_dir=image_dir), indent=2, ensure_ascii=False))
    except WorkflowFormatError as exc:
        _fail(f"workflow: {exc}")


@comfy_app.command("run")
def run(
    workflow: Path = typer.Argument(..., help="A UI workflow or an API prompt (.json); the format is detected."),
    comfy_models: Optional[Path] = ModelsOption,
    comfy_loras: Optional[Path] = LorasOption,
    comfy_diffusion_models: Optional[Path] = DiffusionModelsOption,
    output_dir: Path = typer.Option(Path("output"), "--output-dir", "-o", help="Where the save nodes write (ComfyUI's output folder)."),
    input_dir: Optional[Path] = typer.Option(
        None, "--input-dir", help="Where LoadImage finds its files (ComfyUI's input folder; default: the workflow's folder).",
    ),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Deploy config (its plugins, limits and cards' device)."),
) -> None:
    """Run a ComfyUI workflow on fv and write the files its save nodes name."""
    from fv_kernel.api import DeployConfig, DeployConfigError, FvError, PluginError, PluginHost, load_deploy_config
    from fv_comfyui.convert import WorkflowFormatError
    from fv_comfyui.loras import LoraFileError
    from fv_comfyui.models import ComfyModelsError, ModelMap
    from fv_comfyui.run import JobRunner, OutputFileError, save_outputs
    from fv_comfyui.service import service_for
    from fv_comfyui.settings import (DISTRIBUTION, MODELS_ENV, ComfySettingsError, diffusion_models_folder, loras_folder,
                                     models_file)

    document = _read_document(workflow)
    try:
        deploy = load_deploy_config(config) if config is not None else DeployConfig()
        mapping = comfy_models if comfy_models is not None else models_file(deploy)
        if mapping is None:
            _fail(f"no model mapping file: pass --comfy-models FILE, set {MODELS_ENV}, or set "
                  f"plugins.settings.{DISTRIBUTION}.models in the deploy config (--config)")
        models = ModelMap.from_yaml(mapping)
        host = PluginHost(deploy.plugins)
        host.start()
        loras = comfy_loras if comfy_loras is not None else loras_folder(deploy)
        unets = comfy_diffusion_models if comfy_diffusion_models is not None else diffusion_models_folder(deploy)
        if unets is not None and not unets.is_dir():
            _fail(f"diffusion_models: {str(unets)!r} is not a folder (ComfyUI's models/diffusion_models)")
        service = service_for(host, models, input_dir or workflow.parent, limits=deploy.limits, loras=loras,
                              adapters=deploy.adapters is None or deploy.adapters.enabled,  # as fv.load: on unless turned off
                              diffusion_models=unets)
        answer = service.check(document)
    except (ComfyModelsError, WorkflowFormatError, ComfySettingsError, PluginError) as exc:
        _fail(" ".join(str(exc).split()))
    except DeployConfigError as exc:
        _fail(exc.message)
    if not answer.ok:
        typer.echo(json.dumps(answer.body(), ensure_ascii=False), err=True)
        raise typer.Exit(2)
    for node_id, entry in answer.node_errors.items():  # accepted, but these outputs will not run
        first = entry["errors"][0]
        typer.echo(f"warning: node {node_id} ({entry['class_type']}): {first['message']}: {first['details']}; "
                   f"skipping output(s) {', '.join(entry['dependent_outputs'])}", err=True)
    runner = JobRunner(config=deploy, loras=service.loras)
    try:
        for job in answer.jobs:
            image = service.image_path(job.image_name) if job.image_name else None
            video = runner.run(job, image, on_event=_progress_printer(job, answer.prompt))
            for saved in save_outputs(video, job.outputs, output_dir):
                typer.echo(f"wrote {output_dir / saved.subfolder / saved.filename} (node {saved.node_id})")
    except FvError as exc:
        _fail(exc.message)
    except (OutputFileError, LoraFileError) as exc:
        _fail(str(exc))
