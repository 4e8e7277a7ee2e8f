"""``fv generate``: one request, end to end, on a resident instance, written to a file.

Bad input is one line naming the field and the allowed values, a non-zero exit, and
no file written.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import ValidationError

from fv_kernel.model.instance import build_instance
from fv_kernel.model.preflight import preflight
from fv_kernel.model.validate import check_envelope, resolve_request
from fv_kernel.cli.deploy_options import ConfigOption, load_config, start_host
from fv_kernel.io.progress import StageProgress
from fv_kernel.errors import FvError, InvalidRequest
from fv_kernel.io.media import VIDEO_OUTPUT_SUFFIXES, MediaError, check_output_path, read_image, write_artifact
from fv_kernel.plugins import PluginError
from fv_kernel.request.artifacts import AudioArtifact, TextArtifact, VideoArtifact
from fv_kernel.request.request import AdapterRef, ARParams, DiffusionParams, ImagePart, Request, TextPart
from fv_kernel.request.types import PRECISIONS, TaskType
from fv_kernel.cache.adapters import AdapterSettings
from fv_kernel.deploy.engine import adapter_registry, engine_for
from fv_kernel.deploy.model_resolution import resolve_model
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.records import GenerationResult

__all__ = ["generate"]

#: What a video is written as: the io layer's one list, shared with ``Video.save``.
_OUTPUT_SUFFIXES = VIDEO_OUTPUT_SUFFIXES
#: What ``--task text_generation`` writes: the text (.txt) or it with its model, task and token ids (.json); ``-`` prints it.
_TEXT_OUTPUT_SUFFIXES = (".txt", ".json")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _validation_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"] if p not in ("diffusion", "ar")) or "request"
    return f"{field}: {err['msg']}"


def generate(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Card id (see 'fv cards list'), a card file (.json/.yaml, checked as 'fv cards validate' does), a local checkpoint directory, or a hub id (default: the installed plugins' default card)."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="What to generate."),
    output: Path = typer.Option(..., "--output", "-o", help="Output file: .mp4 (H.264; with --task text_to_video_audio the sound is its AAC track), .gif (animated), .pt (float32 tensor (F,3,H,W) in [0,1]), .png (first frame) (.gif/.pt/.png: the sound goes to a .wav beside it, named in the output). --task text_generation: .txt (the text), .json (text, token ids, model, task) or - (print it)."),
    negative_prompt: Optional[str] = typer.Option(None, "--negative-prompt", help="What to steer away from (cards with CFG)."),
    image: Optional[Path] = typer.Option(None, "--image", help="Conditioning image for image-to-video."),
    task: Optional[TaskType] = typer.Option(None, "--task", help="Declare the task; default: image_to_video with --image, else text_to_video."),
    height: Optional[int] = typer.Option(None, "--height"),
    width: Optional[int] = typer.Option(None, "--width"),
    frames: Optional[int] = typer.Option(None, "--frames"),
    steps: Optional[int] = typer.Option(None, "--steps"),
    guidance: Optional[float] = typer.Option(None, "--guidance"),
    guidance_2: Optional[float] = typer.Option(None, "--guidance-2", help="Guidance of the second expert (two-expert cards)."),
    switch_step: Optional[int] = typer.Option(
        None, "--switch-step", help="Two-expert cards: the step from which the second expert runs (0..steps; default: the card's boundary).",
    ),
    shift: Optional[float] = typer.Option(None, "--shift"),
    sampler: Optional[str] = typer.Option(
        None, "--sampler",
        help="Sampler of the denoise loop (the card's default if omitted): one a card loop binds, or any sampler an "
             "enabled plugin registers (the default loop then runs it with its own defaults) unless the recipe fixes the loop.",
    ),
    seed: int = typer.Option(0, "--seed"),
    precision: Optional[str] = typer.Option(None, "--precision", help=f"One of {', '.join(PRECISIONS)} (the card's default if omitted)."),
    precision_path: Optional[str] = typer.Option(
        None, "--precision-path",
        help="What runs in fp8: native, a path the card lists (fp8_weights, fp8_dynamic, fp8_attention, fp8_all), or "
             "auto (the fastest listed path whose recorded measurement passes its contract); the card's own if omitted.",
    ),
    override_recipe: bool = typer.Option(
        False, "--override-recipe",
        help="Run in a --precision or --precision-path the card's recipe excludes (assumes_precision) instead of refusing.",
    ),
    allow_outside_envelope: bool = typer.Option(
        False, "--allow-outside-envelope",
        help="Run frames, sizes, fps or prompt words outside what the card was trained on (its recipe's envelope) "
             "instead of refusing; prints a warning.",
    ),
    device: Optional[str] = typer.Option(
        None, "--device", help="torch device, e.g. cpu or cuda (default: the config's entry for --model, else cpu)."
    ),
    upsample_prompt: bool = typer.Option(False, "--upsample-prompt", help="Rewrite the prompt with the card's reasoner first (cards that have one)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Token budget of the prompt rewrite, or of the answer with --task text_generation (the card's default if omitted)."),
    lora: list[str] = typer.Option(
        [], "--lora",
        help="A LoRA adapter file (.safetensors, any common format the card reads) and its strength, FILE[:SCALE] "
             "(default 1.0); repeat to stack several, applied in order after the card's default stack.",
    ),
    component_source: list[str] = typer.Option(
        [], "--component-source",
        help="COMPONENT=FILE: load that component's weights from one .safetensors file (e.g. "
             "transformer=wan2.1_t2v_1.3B_fp8_scaled.safetensors, ComfyUI's diffusion_models files) with the card's "
             "config; repeat for several components. Only components the card marks single_file take one.",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Generate a video (or image) with one card and write it to --output.

    With --config, the deploy config applies as it does to ``fv serve``: its ``plugins``
    select the plugins, its ``limits``, ``scheduler`` and ``extensions`` apply, and its
    ``cards`` entry for --model (if any) gives the instance options (device, precision,
    attention_backend, compute, local_files_only, override_recipe, component_sources; flags win). Other
    cards it lists are not loaded.
    """
    try:  # before any compute: the suffix, and that a file can be created there
        if not (task is TaskType.TEXT_GENERATION and str(output) == "-"):
            check_output_path(output, _TEXT_OUTPUT_SUFFIXES if task is TaskType.TEXT_GENERATION else _OUTPUT_SUFFIXES)
    except MediaError as exc:
        _fail(exc.message)
    if precision is not None and precision not in PRECISIONS:
        _fail(f"precision: {precision!r} is not a precision; allowed: {', '.join(PRECISIONS)}")
    try:
        lora_files = [parse_lora_option(item) for item in lora]
        component_sources = parse_component_sources(component_source)
    except InvalidRequest as exc:
        _fail(exc.message)
        return
    try:
        chosen_task = task or (TaskType.IMAGE_TO_VIDEO if image is not None else TaskType.TEXT_TO_VIDEO)
        inputs: list[Any] = [TextPart(text=prompt)]
        if negative_prompt:
            inputs.append(TextPart(text=negative_prompt, role="negative_prompt"))
        if image is not None:
            inputs.append(ImagePart(image=read_image(image)))
        request = Request(
            # No --model: the plugins' default card, whose id replaces this one once resolved below.
            model=model or "default", task=chosen_task, inputs=tuple(inputs), precision=precision,  # type: ignore[arg-type]
            prompt_upsampling=upsample_prompt, allow_outside_envelope=allow_outside_envelope,
            ar=(ARParams(max_tokens=max_tokens, seed=seed)
                if (upsample_prompt or chosen_task is TaskType.TEXT_GENERATION) and max_tokens is not None else None),
            diffusion=DiffusionParams(height=height, width=width, frames=frames, steps=steps, guidance=guidance,
                                      guidance_2=guidance_2, switch_step=switch_step, shift=shift, sampler=sampler, seed=seed),
        )
    except ValidationError as exc:
        message = _validation_line(exc)
        if "needs input part(s) ['image']" in message:
            message = f"image: task {chosen_task.value!r} needs --image"
        _fail(message)
        return
    except FvError as exc:
        _fail(exc.message)
        return

    progress = StageProgress(not quiet)
    try:
        with progress.loading(model or "the default card") as loading:
            deploy = load_config(config)
            if deploy.parallel is not None and deploy.parallel.world_size > 1:
                _fail(f"parallel: fv generate runs one process; a plan of {deploy.parallel.world_size} ranks is "
                      "served by fv serve --config (docs/parallelism.md)")
            host = start_host(deploy)
            # The config's entry for this card (if any) gives the instance options; flags win.
            choice = resolve_model(model, deploy, host, device=device, precision=precision, override_recipe=override_recipe,
                                   precision_path=precision_path, component_sources=component_sources)
            card, options = choice.card, choice.options
            request = request.with_updates(model=card.model_id)
            registry = None
            if lora_files or deploy.adapters is not None:
                if lora_files and deploy.adapters is None:  # --lora turns adapters on with the default settings
                    deploy = deploy.model_copy(update={"adapters": AdapterSettings()})
                registry = adapter_registry(deploy, [card])
                if registry is None:
                    _fail("lora: the deploy config turns adapters off (adapters.enabled: false)")
                    return
                refs = [
                    AdapterRef(name=registry.add_file(path, name=_free_name(registry, path)).name, scale=scale)
                    for path, scale in lora_files
                ]
                request = request.with_updates(adapters=(*request.adapters, *refs))
            engine = engine_for(deploy, host, adapters=registry)
            # every input error surfaces before weights load
            try:
                resolved = resolve_request(
                    card, request, deploy.limits, allow_recipe_mismatch=options.allow_recipe_mismatch,
                    samplers=host.registry().sampler_names(), adapters=registry,
                )
            except InvalidRequest as exc:
                if exc.param == "prompt_upsampling":
                    _fail(f"{exc.message}{_cards_that_upsample(host)}")
                raise
            for warning in check_envelope(card, resolved):  # unknown words; an overridden envelope
                typer.echo(f"warning: {warning}", err=True)
            # the checkpoint source is there and the weights fit, before anything is built
            preflight(card, options, (request.task,))
            loading.validated(card.model_id)
            instance = build_instance(card, options)
            instance.load_for_task(request.task)  # weights load here, so a bad checkpoint is one typed line
            engine.add_instance(instance)
        selection = instance.precision_selection
        if selection is not None and selection.asked == "auto":  # say what auto chose, and why
            typer.echo(f"precision path: {selection.path} ({selection.reason})", err=True)
        if instance.recipe_overrides:
            typer.echo(
                f"warning: running {card.model_id!r} outside its recipe {card.recipe.method!r} "
                f"(overridden: {', '.join(instance.recipe_overrides)}; precision {instance.precision!r}, precision path "
                f"{instance.precision_path!r}, attention "
                f"{instance.options.attention_backend!r}) because of --override-recipe",
                err=True,
            )
        result = host.hooks.wrap_generate(request, lambda req: _run(engine, req, progress))
    except FvError as exc:
        _fail(exc.message)
        return
    except PluginError as exc:
        _fail(str(exc))
        return
    except KeyboardInterrupt:  # start-up or generation: close the progress line, then one line, exit 130
        progress.close()
        from fv_kernel.cli.app import interrupted

        interrupted()
    if result.status != "completed":
        detail = result.error.message if result.error else result.status
        _fail(f"generation {result.status}: {detail}")
        return
    if card.random_weights and request.task is TaskType.TEXT_GENERATION:
        typer.echo(f"warning: card {card.model_id!r} has random weights (seeded, never trained: "
                   f"{', '.join(card.random_weight_components)}): its text means nothing", err=True)
    try:
        for line in write_result(result.artifacts, output, card.model_id, request.task, random_weights=card.random_weights):
            typer.echo(line)
    except MediaError as exc:
        _fail(exc.message)
        return


def parse_lora_option(value: str) -> tuple[Path, float]:
    """``FILE[:SCALE]`` as (path, strength): the text after the last ``:`` is the strength when it
    is a number (so ``C:\\x.safetensors`` and ``a:b.safetensors`` stay paths)."""
    path_text, scale = value, 1.0
    head, sep, tail = value.rpartition(":")
    if sep and head:
        try:
            scale = float(tail)
            path_text = head
        except ValueError:
            pass
    if not math.isfinite(scale):
        raise InvalidRequest("lora", f"{value!r}: the strength must be a finite number")
    path = Path(path_text)
    if path.suffix.lower() != ".safetensors":
        raise InvalidRequest("lora", f"{value!r}: an adapter file is a .safetensors file", allowed="FILE.safetensors[:SCALE]")
    if not path.is_file():
        raise InvalidRequest("lora", f"{str(path)!r}: no such file")
    return path, scale


def parse_component_sources(values: list[str]) -> dict[str, Path]:
    """``COMPONENT=FILE`` options as a mapping; a malformed or repeated component is a typed error
    (whether the card has the component and the file exists is checked when the card is loaded)."""
    sources: dict[str, Path] = {}
    for value in values:
        component, sep, path = value.partition("=")
        if not sep or not component or not path:
            raise InvalidRequest("component_sources", f"{value!r} is not COMPONENT=FILE",
                                 allowed="e.g. transformer=wan2.1_t2v_1.3B_fp8_scaled.safetensors")
        if component in sources:
            raise InvalidRequest(f"component_sources.{component}", f"given twice ({str(sources[component])!r} and {path!r})")
        sources[component] = Path(path)
    return sources


def _free_name(registry: Any, path: Path) -> str:
    """The file's stem, or the stem with a number when two --lora files share one."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", path.stem).lstrip("._-")[:120] or "lora"
    taken = set(registry.names())
    name, n = stem, 2
    while name in taken:
        name, n = f"{stem}-{n}", n + 1
    return name


def _cards_that_upsample(host: Any) -> str:
    """``"; cards with a reasoner: ..."`` over the installed cards (empty when none has one)."""
    from fv_kernel.model.catalog import CardCatalog
    from fv_kernel.model.validate import reasoner_loops

    able = []
    for model_id, entry in sorted(CardCatalog(host).entries().items()):
        loops = reasoner_loops(entry.card)
        if loops:
            able.append(f"{model_id} (loop {', '.join(loops)})")
    return f"; cards with a reasoner: {', '.join(able)}" if able else ""


def _run(engine: Engine, request: Request, progress: StageProgress) -> GenerationResult:
    async def go() -> GenerationResult:
        async with engine.running():
            handle = engine.submit(request)
            async for event in handle.events():
                if event.type == "progress":
                    progress.update(event.loop_id, event.step, event.total)
            progress.close()
            return await handle.result()

    return _run_until_interrupted(go())


def _run_until_interrupted(coro: Any) -> Any:
    """``asyncio.run(coro)``, except that on Ctrl-C fv goes quiet before the loop shuts down: the
    shutdown cancels what is left and logs what fails on the way, which would follow the one
    ``fv: interrupted`` line."""
    from fv_kernel.cli.app import _quiet_teardown
    from fv_kernel.runtime.blocking import run_in_runner

    with asyncio.Runner() as runner:
        try:
            return run_in_runner(runner, coro)
        except KeyboardInterrupt:
            _quiet_teardown()
            raise


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: every non-printable character (ESC, BEL, newlines,
    other controls) as its Python escape (``\\x1b``), so model output cannot drive the terminal."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def write_result(
    artifacts: list[Any], output: Path, model_id: str, task: TaskType, *, random_weights: bool = False
) -> list[str]:
    """Write a finished request's artifacts to ``output``; the lines to print (text escaped by :func:`printable`).

    ``random_weights`` (the card's): its text means nothing, so it is never printed as if it did: a
    rewritten prompt is not shown, and a written answer's line says so (``generate`` also warns on
    stderr, which keeps a printed answer alone on stdout).

    ``text_generation``: the answer to ``.txt`` (as generated), ``.json`` (``text``, ``token_ids``,
    ``model``, ``task``) or, for ``-``, printed. Other tasks: the video by suffix; its sound (the
    video+audio task) muxed into an ``.mp4`` as an AAC track, or beside a ``.pt`` / ``.png`` as a
    ``.wav`` named in the output; a rewritten prompt printed as ``upsampled_prompt: ...``.
    """
    texts = [a for a in artifacts if isinstance(a, TextArtifact)]
    if task is TaskType.TEXT_GENERATION:
        if not texts:
            raise MediaError(f"model: card {model_id!r} returned no text for task 'text_generation'", param="model")
        answer = texts[0]
        caveat = f" (card {model_id!r} has random weights: this text is meaningless)" if random_weights else ""
        if str(output) == "-":  # stdout is the answer alone (a pipe); generate() warns on stderr
            return [printable(answer.text)]
        payload = answer.text
        if output.suffix.lower() == ".json":
            payload = json.dumps(
                {"model": model_id, "task": task.value, "text": answer.text, "token_ids": list(answer.token_ids)},
                ensure_ascii=False,
            ) + "\n"
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(payload, encoding="utf-8")
        except OSError as exc:
            raise MediaError(f"output: cannot write {str(output)!r}: {exc.strerror or exc}", param="output") from None
        return [f"wrote {output} ({len(answer.text)} characters, {len(answer.token_ids)} tokens){caveat}"]
    if random_weights:
        lines = [f"{a.name}: not shown: card {model_id!r} has random weights, its text is meaningless "
                 f"({len(a.text)} characters)" for a in texts]
    else:
        lines = [f"{a.name}: {printable(a.text)}" for a in texts]
    videos = [a for a in artifacts if isinstance(a, VideoArtifact)]
    if not videos:
        raise MediaError(f"model: card {model_id!r} returned no video for task {task.value!r}", param="model")
    video = videos[0]
    audio = next((a for a in artifacts if isinstance(a, AudioArtifact)), None)
    shape = f"{video.frames.shape[0]} frames, {video.frames.shape[3]}x{video.frames.shape[2]}, {video.fps:g} fps"
    if audio is not None and output.suffix.lower() == ".mp4":
        written = write_artifact(video, output, audio=audio)
        seconds = audio.samples.shape[-1] / audio.sample_rate
        return [*lines, f"wrote {written} ({shape}; sound: AAC track, {seconds:.2f} s, {audio.samples.shape[0]} channel(s))"]
    written = write_artifact(video, output)
    lines.append(f"wrote {written} ({shape})")
    if audio is not None:
        sidecar = write_artifact(audio, output.with_suffix(".wav"))
        lines.append(f"wrote {sidecar} (the sound: {output.suffix} holds no audio; {audio.sample_rate} Hz WAV)")
    return lines
