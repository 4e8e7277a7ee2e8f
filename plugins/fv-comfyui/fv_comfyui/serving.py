"""ComfyUI's HTTP surface on ``fv serve`` (mounted through the kernel's ``fv_serving_routes`` hook).

Routes, answering as ComfyUI's ``server.py`` does, so existing ComfyUI API clients work:

- ``POST /prompt``: ``{"prompt", "client_id"?, "prompt_id"?, "extra_data"?, "partial_execution_targets"?}``
  → ``{"prompt_id", "number", "node_errors"}`` (200), or ``{"error", "node_errors"}`` (400);
  no ``prompt`` → ``no_prompt``. Validation and compilation happen here, before anything runs.
- ``GET /prompt`` and ``GET /queue``; ``GET /history``, ``GET /history/{prompt_id}`` (``{}`` when unknown);
- ``GET /view?filename=&subfolder=&type=output|input`` (never outside those folders);
- ``POST /upload/image`` (multipart ``image``, ``subfolder``, ``overwrite``) → ``{"name", "subfolder", "type"}``;
- ``GET /object_info`` and ``/object_info/{node_class}``: the nodes fv covers, with the served
  mapping's model names;
- ``POST /interrupt`` (optional body ``{"prompt_id"}``: only if that prompt is the one running):
  cancels the running prompt at its next step; the queue goes on with the next one;
- ``GET /system_stats``; ``/ws?clientId=``: ``status`` on connect and on queue changes, then per
  prompt ``execution_start``, ``execution_cached``, ``executing`` (each node; ``node: null`` at
  the end), ``progress`` (the sampler's steps: ``value``/``max``, ``node``, ``prompt_id``), a
  binary latent preview per sampler step (:mod:`fv_comfyui.previews`; off with
  ``plugins.settings.fv-comfyui.previews: false``), ``executed`` (each save node's files), and
  ``execution_success``, ``execution_error`` or ``execution_interrupted``.

Prompts run one at a time, in order, on the server's engine (the cards ``fv serve`` serves; a
prompt whose loaders map to another card is refused at ``POST /prompt``). The model mapping
is the deploy config's ``plugins.settings.fv-comfyui.models`` (``fv serve --config``), or the
file ``FV_COMFY_MODELS`` names, which overrides it (:mod:`fv_comfyui.settings`).
Files live under the server's data dir: ``<output_dir>/comfyui/input`` and ``.../output``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from fastapi import Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import UploadFile  # what request.form() returns (FastAPI's is a subclass)

from fv_kernel.api import DeployConfig, Engine, FvError
from fv_comfyui.compile import ComfyJob, WeightFiles
from fv_comfyui.loras import LoraFolder, LoraLibrary, adapter_registry
from fv_comfyui.models import ModelMap
from fv_comfyui.paths import inside
from fv_comfyui.nodes import object_info
from fv_comfyui.previews import LatentPreviewer, preview_frame
from fv_comfyui.run import save_outputs
from fv_comfyui.service import ComfyService
from fv_comfyui.settings import (DISTRIBUTION, MODELS_ENV, comfy_settings, diffusion_models_folder, loras_folder,
                                 models_file)

__all__ = ["MODELS_ENV", "ComfyServer", "mount"]

_log = logging.getLogger("fv_comfyui")



@dataclass
class _Item:
    number: int
    prompt_id: str
    prompt: dict[str, Any]
    extra_data: dict[str, Any]
    outputs: list[str]
    jobs: list[ComfyJob]
    client_id: str | None
    messages: list[list[Any]] = field(default_factory=list)
    #: The node last reported as executing (named in an ``execution_error``).
    current: str | None = None
    #: ``POST /interrupt`` asked to stop this prompt; the engine request it is running, if any.
    interrupted: bool = False
    request_id: str | None = None

    def queue_entry(self) -> list[Any]:
        return [self.number, self.prompt_id, self.prompt, self.extra_data, self.outputs]


class _Interrupted(Exception):
    """The running prompt was interrupted (``POST /interrupt``)."""


def _schedule(job: ComfyJob) -> Any:
    """The job's sigmas, as its ``comfy-<sampler>-<scheduler>`` sampler makes them (``init_state``:
    uni_pc's drops the next-to-last sigma, as ``KSampler`` does), or None."""
    from fv_comfyui.samplers import COMFY_SAMPLERS

    sampler = {cls.name: cls for cls in COMFY_SAMPLERS}.get(str(job.options.get("sampler") or ""))
    if sampler is None:
        return None
    try:
        return sampler(shift=float(job.options["shift"])).init_state(int(job.options["steps"])).sigmas
    except (KeyError, ValueError):
        return None


class ComfyServer:
    """The queue, history and websocket clients of the ComfyUI surface over one engine."""

    def __init__(self, engine: Engine, config: DeployConfig, models: ModelMap, *, previews: bool = True,
                 loras: Path | None = None, diffusion_models: Path | None = None) -> None:
        self.engine = engine
        #: Latent previews over /ws at each sampler step (``plugins.settings.fv-comfyui.previews``).
        self.previews = previews
        root = Path(config.output_dir) / "comfyui"
        self.input_dir = root / "input"
        self.output_dir = root / "output"
        self.input_dir.mkdir(parents=True, exist_ok=True)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        instances = engine.instances
        registry = next(iter(instances.values())).registry if instances else None
        self.service = ComfyService(
            models=models, cards={model_id: instance.card for model_id, instance in instances.items()},
            input_dir=self.input_dir, sampler_names=tuple(registry.sampler_names()) if registry else (),
            limits=config.limits, loras=LoraLibrary(LoraFolder(loras) if loras is not None else None),
            adapters_off=frozenset(m for m, instance in instances.items() if not instance.adapters_enabled),
            served_paths={m: str(instance.precision_path) for m, instance in instances.items()},
            weight_files=WeightFiles(diffusion_models=diffusion_models,
                                     served={m: dict(instance.options.component_sources) for m, instance in instances.items()}),
        )
        self.folders = {**models.folders()}
        self.number = 0
        self.pending: list[_Item] = []
        self.running: _Item | None = None
        self.history: dict[str, dict[str, Any]] = {}
        self.clients: dict[str, Any] = {}
        self.wakeup: asyncio.Event | None = None
        self.worker: asyncio.Task[None] | None = None

    # -- queue ----------------------------------------------------------------------------
    def remaining(self) -> int:
        return len(self.pending) + (1 if self.running is not None else 0)

    def status_message(self, sid: str | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {"status": {"exec_info": {"queue_remaining": self.remaining()}}}
        if sid is not None:
            data["sid"] = sid
        return {"type": "status", "data": data}

    async def send(self, message: dict[str, Any], client_id: str | None) -> None:
        """To one client (ComfyUI's per-prompt messages), or to every client when ``client_id`` is None."""
        targets = list(self.clients.items()) if client_id is None else [(client_id, self.clients.get(client_id))]
        for sid, socket in targets:
            if socket is None:
                continue
            try:
                await socket.send_text(json.dumps(message))
            except Exception:  # noqa: BLE001 - a client that went away just stops receiving
                self.clients.pop(sid, None)

    async def send_bytes(self, data: bytes, client_id: str | None) -> None:
        """A binary message (a preview frame), to whom :meth:`send` would send it."""
        targets = list(self.clients.items()) if client_id is None else [(client_id, self.clients.get(client_id))]
        for sid, socket in targets:
            if socket is None:
                continue
            try:
                await socket.send_bytes(data)
            except Exception:  # noqa: BLE001 - a client that went away just stops receiving
                self.clients.pop(sid, None)

    def interrupt(self, prompt_id: str | None = None) -> bool:
        """Stop the running prompt (only if it is ``prompt_id``, when given); the queue goes on. Whether one was stopped."""
        item = self.running
        if item is None or (prompt_id is not None and item.prompt_id != prompt_id):
            return False
        item.interrupted = True
        if item.request_id is not None:
            self.engine.cancel(item.request_id, "interrupted (POST /interrupt)")
        return True

    async def enqueue(self, item: _Item) -> None:
        if self.worker is None or self.worker.done():
            self.wakeup = asyncio.Event()
            self.worker = asyncio.create_task(self.work())
        self.pending.append(item)
        self.pending.sort(key=lambda queued: queued.number)  # ComfyUI runs the lowest number first
        assert self.wakeup is not None
        self.wakeup.set()
        await self.send(self.status_message(), None)

    async def work(self) -> None:
        assert self.wakeup is not None
        while True:
            if not self.pending:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            self.running = self.pending.pop(0)
            try:
                await self.execute(self.running)
            finally:
                self.running = None
                await self.send(self.status_message(), None)

    # -- execution ------------------------------------------------------------------------
    async def message(self, item: _Item, kind: str, data: dict[str, Any], *, record: bool = False) -> None:
        data = {**data, "prompt_id": item.prompt_id}
        if record:
            item.messages.append([kind, data])
        await self.send({"type": kind, "data": data}, item.client_id)

    async def executing(self, item: _Item, node: str | None) -> None:
        item.current = node
        await self.message(item, "executing", {"node": node, "display_node": node})

    async def execute(self, item: _Item) -> None:
        outputs: dict[str, Any] = {}
        await self.message(item, "execution_start", {"timestamp": int(time.time() * 1000)}, record=True)
        await self.message(item, "execution_cached", {"nodes": [], "timestamp": int(time.time() * 1000)}, record=True)
        try:
            for job in item.jobs:
                outputs.update(await self.run_job(item, job))
        except _Interrupted:
            # As ComfyUI: to every client, recorded in the history, which says "error".
            await self.send({"type": "execution_interrupted", "data": await self.interrupted_data(item, outputs)}, None)
            self.finish(item, outputs, "error")
            await self.executing(item, None)
            return
        except Exception as exc:  # noqa: BLE001 - reported to the client as ComfyUI reports a failed node
            await self.message(item, "execution_error", {
                "node_id": item.current,
                "node_type": item.prompt[item.current]["class_type"] if item.current in item.prompt else None,
                "executed": list(outputs), "exception_message": str(exc),
                "exception_type": type(exc).__name__, "traceback": [], "current_inputs": {}, "current_outputs": {},
                "timestamp": int(time.time() * 1000),
            }, record=True)
            self.finish(item, outputs, "error")
            await self.executing(item, None)
            return
        # As ComfyUI: execution_success, the history entry, then ``executing`` null (what clients wait for).
        await self.message(item, "execution_success", {"timestamp": int(time.time() * 1000)}, record=True)
        self.finish(item, outputs, "success")
        await self.executing(item, None)

    async def interrupted_data(self, item: _Item, outputs: dict[str, Any]) -> dict[str, Any]:
        node = item.current
        data = {"prompt_id": item.prompt_id, "node_id": node,
                "node_type": item.prompt[node]["class_type"] if node in item.prompt else None,
                "executed": list(outputs), "timestamp": int(time.time() * 1000)}
        item.messages.append(["execution_interrupted", data])
        return data

    def finish(self, item: _Item, outputs: dict[str, Any], status: str) -> None:
        self.history[item.prompt_id] = {
            "prompt": item.queue_entry(), "outputs": outputs,
            "status": {"status_str": status, "completed": status == "success", "messages": item.messages},
            "meta": {node: {"node_id": node, "display_node": node, "parent_node": None, "real_node_id": node} for node in outputs},
        }

    async def run_job(self, item: _Item, job: ComfyJob) -> dict[str, Any]:
        card = job.card
        by_kind: dict[str, list[str]] = {}
        for node in job.nodes:  # which prompt nodes each of the card's loop kinds stands for
            kind = {"CLIPTextEncode": "text_encode", "CLIPVisionEncode": "image_encode", "WanImageToVideo": "image_encode",
                    "KSampler": "diffusion_denoise", "KSamplerAdvanced": "diffusion_denoise",
                    "VAEDecode": "vae_decode"}.get(str(item.prompt[node]["class_type"]))
            if item.prompt[node]["class_type"] == "Wan22ImageToVideoLatent" and job.image_name is not None:
                kind = "image_encode"  # the start image's VAE encode
            if kind is not None:
                by_kind.setdefault(kind, []).append(node)
        saves = {t.node_id for t in job.outputs}
        for node in job.nodes:  # loaders and the like: ready as soon as the request is admitted
            if item.prompt[node]["class_type"] in ("UNETLoader", "CLIPLoader", "VAELoader", "CLIPVisionLoader",
                                                   "CheckpointLoaderSimple", "LoraLoader", "LoraLoaderModelOnly",
                                                   "ModelSamplingSD3", "LoadImage", "EmptyHunyuanLatentVideo") or (
                    item.prompt[node]["class_type"] == "Wan22ImageToVideoLatent" and job.image_name is None):
                await self.executing(item, node)
        if item.interrupted:
            raise _Interrupted()
        image = self.service.load_image(job.image_name) if job.image_name else None
        # The LoRA files as the engine's adapters (read and converted once; again only when a file changes).
        adapters = await asyncio.to_thread(
            self.service.loras.register, adapter_registry(self.engine.instances[card.model_id]), job.loras,
        ) if job.loras else ()
        pending: list[bytes] = []
        handle = self.engine.submit(job.request(image, adapters), on_step=self.previewer(job, pending) if self.previews else None)
        item.request_id = handle.request_id
        shown: str | None = None
        async for event in handle.events():
            if event.type != "progress":
                continue
            spec = card.loops.get(event.loop_id)
            nodes = by_kind.get(spec.kind if spec is not None else "", [])
            if not nodes:
                continue
            node = nodes[-1] if spec is not None and spec.kind == "diffusion_denoise" else nodes[0]
            if node != shown:
                for earlier in nodes[:-1] if spec is not None and spec.kind == "diffusion_denoise" else nodes[1:]:
                    await self.executing(item, earlier)
                await self.executing(item, node)
                shown = node
            if spec is not None and spec.kind == "diffusion_denoise" and event.total:
                await self.message(item, "progress", {"value": event.step, "max": event.total, "node": node})
                for frame in pending:  # the step's preview, after its progress, as ComfyUI sends them
                    await self.send_bytes(frame, item.client_id)
                pending.clear()
        result = await handle.result()
        item.request_id = None
        if result.status == "cancelled" and item.interrupted:
            raise _Interrupted()
        result.raise_for_status()
        video = result.artifact("video")
        assert video is not None
        saved = await asyncio.to_thread(save_outputs, SimpleNamespace(frames=video.frames), job.outputs, self.output_dir)
        outputs: dict[str, Any] = {}
        for node in job.nodes:
            if node in saves:
                await self.executing(item, node)
                files = [s.history_entry() for s in saved if s.node_id == node]
                output = {"images": files, "animated": [True]}
                outputs[node] = output
                await self.message(item, "executed", {"node": node, "display_node": node, "output": output})
        return outputs

    def previewer(self, job: ComfyJob, pending: list[bytes]) -> Any:
        """The engine's ``on_step`` hook: after each denoise step, the step's preview frame into ``pending``."""
        card = job.card
        latent_preview = LatentPreviewer(_schedule(job))
        failed: list[str] = []

        def on_step(run: Any) -> None:
            if failed:
                return
            try:
                checkpoint = run.checkpoint()  # the running loops' states (tensors referenced, not copied)
            except FvError:
                return  # a loop whose state cannot be read this step: no preview for it
            try:
                for running in checkpoint.running:
                    spec = card.loops.get(running.loop_id)
                    latents = running.state.get("data", {}).get("latents") if isinstance(running.state, dict) else None
                    if spec is None or spec.kind != "diffusion_denoise" or not isinstance(latents, torch.Tensor):
                        continue
                    pending.append(preview_frame(latent_preview(latents, int(running.step))))
            except Exception as exc:  # noqa: BLE001 - a preview never fails the generation: stop previewing
                failed.append(str(exc))
                _log.warning("fv-comfyui: no more previews for this prompt: %s", exc)

        return on_step

    # -- files ----------------------------------------------------------------------------
    def folder(self, kind: str) -> Path | None:
        return {"output": self.output_dir, "input": self.input_dir}.get(kind)

    @staticmethod
    def inside(root: Path, subfolder: str, filename: str) -> Path | None:
        return inside(root, str(Path(subfolder) / filename))


def mount(app: Any, engine: Engine, config: DeployConfig) -> ComfyServer:
    """Add the ComfyUI routes to ``app`` (see the module doc)."""
    path = models_file(config)
    models = ModelMap.from_yaml(path) if path is not None else ModelMap({})
    unwarned = [path is None]

    def need_mapping() -> None:
        """Warn, once, that no mapping is set: when a ComfyUI route needs it, not at startup
        (a server nobody sends ComfyUI workflows to has nothing to warn about)."""
        if unwarned[0]:
            unwarned[0] = False
            warnings.warn(f"fv-comfyui: no model mapping file (set plugins.settings.{DISTRIBUTION}.models in the deploy "
                          f"config, or {MODELS_ENV}): no model file name maps to a card, so every ComfyUI loader "
                          "answers value_not_in_list", stacklevel=2)

    server = ComfyServer(engine, config, models, previews=comfy_settings(config).previews, loras=loras_folder(config),
                         diffusion_models=diffusion_models_folder(config))
    app.state.comfyui = server

    async def post_prompt(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            error = {"type": "invalid_prompt", "message": "Cannot parse the body as JSON", "details": str(exc), "extra_info": {}}
            return JSONResponse({"error": error, "node_errors": {}}, status_code=400)
        if not isinstance(body, dict) or "prompt" not in body:
            error = {"type": "no_prompt", "message": "No prompt provided", "details": "No prompt provided", "extra_info": {}}
            return JSONResponse({"error": error, "node_errors": {}}, status_code=400)
        need_mapping()
        answer = await asyncio.to_thread(server.service.check, body["prompt"], body.get("partial_execution_targets"))
        if not answer.ok:
            return JSONResponse(answer.body(), status_code=answer.status)
        number = server.number  # ComfyUI's queue numbers: 0, 1, ...; "front" queues ahead (negative)
        server.number += 1
        if body.get("front"):
            number = -number
        prompt_id = str(body.get("prompt_id") or uuid.uuid4())
        extra = dict(body.get("extra_data") or {})
        client_id = body.get("client_id")
        if client_id is not None:
            extra["client_id"] = client_id
        outputs = [t.node_id for job in answer.jobs for t in job.outputs]
        await server.enqueue(_Item(number, prompt_id, answer.prompt, extra, outputs, answer.jobs, client_id))
        return JSONResponse({"prompt_id": prompt_id, "number": number, "node_errors": answer.node_errors})

    async def post_interrupt(request: Request) -> Any:
        try:
            body = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = {}
        prompt_id = body.get("prompt_id") if isinstance(body, dict) else None
        server.interrupt(str(prompt_id) if prompt_id else None)
        return Response(status_code=200)

    async def get_prompt() -> dict[str, Any]:
        return {"exec_info": {"queue_remaining": server.remaining()}}

    async def get_queue() -> dict[str, Any]:
        running = [server.running.queue_entry()] if server.running is not None else []
        return {"queue_running": running, "queue_pending": [i.queue_entry() for i in server.pending]}

    async def get_history(max_items: int | None = None) -> dict[str, Any]:
        items = list(server.history.items())
        if max_items is not None:
            items = items[-max_items:]
        return dict(items)

    async def get_history_item(prompt_id: str) -> dict[str, Any]:
        return {prompt_id: server.history[prompt_id]} if prompt_id in server.history else {}

    async def view(filename: str, subfolder: str = "", type: str = "output") -> Any:  # noqa: A002 - ComfyUI's name
        root = server.folder(type)
        path = server.inside(root, subfolder, filename) if root is not None and filename else None
        if path is None or not path.is_file():
            return JSONResponse({"error": "not found"}, status_code=404)
        return FileResponse(path)

    async def upload_image(request: Request) -> Any:
        form = await request.form()
        image = form.get("image")
        if not isinstance(image, UploadFile) or not image.filename:
            return JSONResponse({"error": "no image"}, status_code=400)
        kind = str(form.get("type") or "input")
        root = server.folder(kind)
        subfolder = str(form.get("subfolder") or "")
        path = server.inside(root, subfolder, Path(image.filename).name) if root is not None else None
        if path is None:
            return JSONResponse({"error": "invalid path"}, status_code=400)
        overwrite = str(form.get("overwrite") or "").lower() in ("true", "1")
        if path.exists() and not overwrite:  # ComfyUI's " (1)" renaming
            stem, suffix, i = path.stem, path.suffix, 1
            while path.exists():
                path = path.with_name(f"{stem} ({i}){suffix}")
                i += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(await image.read())
        return {"name": path.name, "subfolder": subfolder, "type": kind}

    async def get_object_info() -> dict[str, Any]:
        need_mapping()  # its model lists come from the mapping
        return object_info({**server.folders, "loras": server.service.loras.names(), "input": server.service.input_files()})

    async def get_object_info_node(node_class: str) -> dict[str, Any]:
        info = await get_object_info()
        return {node_class: info[node_class]} if node_class in info else {}

    async def system_stats() -> dict[str, Any]:
        import platform
        import sys

        from fv_kernel.api import __version__ as fv_version

        return {"system": {"os": os.name, "python_version": sys.version, "embedded_python": False,
                           "comfyui_version": f"fv {fv_version}", "platform": platform.platform()}, "devices": []}

    async def websocket(socket: WebSocket) -> None:
        await socket.accept()
        sid = socket.query_params.get("clientId") or uuid.uuid4().hex
        server.clients[sid] = socket
        try:
            await socket.send_text(json.dumps(server.status_message(sid)))
            while True:
                await socket.receive_text()  # ComfyUI clients send nothing; this waits for the close
        except WebSocketDisconnect:
            pass
        finally:
            if server.clients.get(sid) is socket:
                server.clients.pop(sid, None)

    app.add_api_route("/prompt", post_prompt, methods=["POST"], include_in_schema=False)
    app.add_api_route("/prompt", get_prompt, methods=["GET"], include_in_schema=False)
    app.add_api_route("/interrupt", post_interrupt, methods=["POST"], include_in_schema=False)
    app.add_api_route("/queue", get_queue, methods=["GET"], include_in_schema=False)
    app.add_api_route("/history", get_history, methods=["GET"], include_in_schema=False)
    app.add_api_route("/history/{prompt_id}", get_history_item, methods=["GET"], include_in_schema=False)
    app.add_api_route("/view", view, methods=["GET"], include_in_schema=False)
    app.add_api_route("/upload/image", upload_image, methods=["POST"], include_in_schema=False)
    app.add_api_route("/object_info", get_object_info, methods=["GET"], include_in_schema=False)
    app.add_api_route("/object_info/{node_class}", get_object_info_node, methods=["GET"], include_in_schema=False)
    app.add_api_route("/system_stats", system_stats, methods=["GET"], include_in_schema=False)
    app.add_api_websocket_route("/ws", websocket)
    return server
