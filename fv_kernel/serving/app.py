"""The FastAPI application: an OpenAI-style video API over one running :class:`Engine`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Literal, Mapping

import torch
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from fv_kernel import __version__
from fv_kernel.cache.adapters import AdapterInfo, AdapterRegistry
from fv_kernel.compute.lora import AdapterError
from fv_kernel.config import DeployConfig
from fv_kernel.errors import AdapterFileError
from fv_kernel.runtime.engine import Engine
from fv_kernel.request.types import TaskType
from fv_kernel.serving import media
from fv_kernel.serving.errors import ApiError, error_body, from_validation_errors
from fv_kernel.serving.jobs import ClientDisconnected, JobManager, StreamEvent
from fv_kernel.serving.limits import JsonLimits, parse_json_object
from fv_kernel.serving.metrics import RequestMetricsMiddleware, ServingMetrics
from fv_kernel.serving.middleware import AuthMiddleware, BodyLimitMiddleware, BodyTooLarge
from fv_kernel.serving.openapi import error_responses, install_openapi, request_body
from fv_kernel.serving.plugin_routes import mount_plugin_routes
from fv_kernel.serving.realtime import PAGE_PATH, mount_realtime
from fv_kernel.serving.schemas import (
    JOB_ID_PATTERN,
    AdapterList,
    AdapterObject,
    ContentVariant,
    DeletedVideo,
    ImageGenerate,
    ImagesResponse,
    ModelInfo,
    ModelList,
    VideoCreate,
    VideoJob,
    VideoList,
    sse_event_schema,
)
from fv_kernel.serving.store import DataDirLock, JobStore

__all__ = ["create_app"]

log = logging.getLogger("fv.serving")

#: Paths that never need the API key (liveness probes; the realtime page, whose WebSocket asks for it).
OPEN_PATHS = frozenset({"/health", PAGE_PATH, PAGE_PATH + "/realtime.js"})
_MAX_FORM_FIELDS = 64


def _encode_sse(item: StreamEvent | None) -> bytes:
    if item is None:
        return b": keep-alive\n\n"
    data = json.dumps(item.data, separators=(",", ":"))
    if item.seq < 0:  # a notice outside the job's stream (server.shutdown): no id, so Last-Event-ID stays put
        return f"event: {item.event}\ndata: {data}\n\n".encode()
    return f"id: {item.seq}\nevent: {item.event}\ndata: {data}\n\n".encode()


def _validate(schema: type[BaseModel], data: Mapping[str, Any], *, strict: bool) -> Any:
    """``data`` as ``schema``. JSON is ``strict`` (the schemas' own setting): its types are the
    document's (``false`` is no number, ``0`` no boolean); form fields are text, parsed as their types."""
    try:
        return schema.model_validate(dict(data), strict=strict)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def _read_json_object(request: Request, limits: JsonLimits) -> dict[str, Any]:
    """The body as a JSON object: its depth and numbers bounded before parsing, off the event loop."""
    return await asyncio.to_thread(parse_json_object, await request.body(), limits)


async def _read_video_create(request: Request, limits: JsonLimits) -> tuple[VideoCreate, bytes | str | None]:
    """``POST /v1/videos`` as JSON (base64 image) or multipart (image file); either way one schema.

    Returns the body and its image still encoded (a file part's bytes, or base64 text):
    the caller checks the task before anything is decoded.
    """
    content_type = _content_type(request)
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.form(max_files=1, max_fields=_MAX_FORM_FIELDS)
        except BodyTooLarge:
            raise
        except Exception as exc:  # noqa: BLE001 - python-multipart raises several types for bad bodies
            raise ApiError(400, "invalid_request", f"malformed multipart body: {exc}") from None
        fields: dict[str, Any] = {}
        image_bytes: bytes | None = None
        for key, value in form.multi_items():
            if key in fields or (key == "input_reference" and image_bytes is not None):
                raise ApiError(400, "invalid_request", f"{key}: given more than once", param=key)
            if isinstance(value, UploadFile):
                if key != "input_reference":
                    raise ApiError(400, "unknown_field", f"{key}: unknown file field; allowed: input_reference", param=key)
                image_bytes = await value.read()
            else:
                fields[key] = value
        for optional in ("extensions", "input_reference"):
            if fields.get(optional) == "":
                del fields[optional]  # an empty form field is an absent one (HTML forms send every field)
        if "extensions" in fields:
            fields["extensions"] = await asyncio.to_thread(parse_json_object, fields["extensions"], limits, param="extensions")
        body = _validate(VideoCreate, fields, strict=False)
        if image_bytes is not None:
            return body, image_bytes
    elif content_type in ("application/json", ""):
        body = _validate(VideoCreate, await _read_json_object(request, limits), strict=True)
    else:
        raise ApiError(
            415, "unsupported_media_type",
            f"content type {content_type!r}; allowed: application/json, multipart/form-data, application/x-www-form-urlencoded",
        )
    return body, body.input_reference


def _load_image(encoded: bytes | str, *, max_pixels: int) -> torch.Tensor:
    """Base64 text or file bytes as pixels; the size its header declares is checked before any decoding.

    Runs on a worker thread: decoding a large image takes long enough to stall every client.
    """
    param = "input_reference"
    data = media.decode_base64(encoded, param=param) if isinstance(encoded, str) else encoded
    media.probe_image(data, param=param, max_pixels=max_pixels)
    return media.decode_pixels(data, param=param)


def _check_image_task(manager: JobManager, body: VideoCreate) -> None:
    """An image asks for image-to-video: refuse it (400) if the card cannot run that, before decoding the image.

    Refusals are counted once, by the manager (``_instance`` counts its own).
    """
    instance = manager._instance(body.model)
    tasks = instance.card.capabilities.tasks
    if TaskType.IMAGE_TO_VIDEO not in tasks:
        allowed = ", ".join(sorted(t.value for t in tasks))
        raise manager.reject(ApiError(
            400, "invalid_request",
            f"input_reference: card {instance.model_id!r} cannot run 'image_to_video' (its tasks: {allowed}); "
            "omit the image, or name a card that takes one",
            param="input_reference",
        ))


#: Multipart framing around an uploaded adapter file (boundaries, part headers, the name field).
_UPLOAD_OVERHEAD_BYTES = 64 * 2**10


def _adapter_object(info: AdapterInfo) -> AdapterObject:
    return AdapterObject(
        name=info.name, version=info.version, size_bytes=info.size_bytes, components=list(info.components),
        rank=info.rank, weight_bytes=info.weight_bytes, assumes_loop=info.assumes_loop,
        assumes_steps=info.assumes_steps, source=info.source,
    )


async def _upload_adapter(request: Request, registry: AdapterRegistry) -> AdapterInfo:
    """``POST /v1/adapters``: a multipart body with one ``file`` part (a ``.safetensors`` LoRA) and
    optional ``name``, ``assumes_loop`` and ``assumes_steps`` fields. The file is converted and
    checked before it is registered, on a worker thread."""
    if _content_type(request) != "multipart/form-data":
        raise ApiError(415, "unsupported_media_type", "an adapter upload is multipart/form-data with a 'file' part")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except BodyTooLarge:
        raise
    except Exception as exc:  # noqa: BLE001 - python-multipart raises several types for bad bodies
        raise ApiError(400, "invalid_request", f"malformed multipart body: {exc}") from None
    upload: UploadFile | None = None
    fields: dict[str, str] = {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key != "file":
                raise ApiError(400, "unknown_field", f"{key}: unknown file field; allowed: file", param=key)
            upload = value
        elif key in ("name", "assumes_loop", "assumes_steps"):
            if key in fields:
                raise ApiError(400, "invalid_request", f"{key}: given more than once", param=key)
            fields[key] = value
        else:
            raise ApiError(400, "unknown_field", f"{key}: unknown field; allowed: file, name, assumes_loop, assumes_steps", param=key)
    if upload is None:
        raise ApiError(400, "invalid_request", "file: an adapter upload needs a 'file' part", param="file")
    steps: int | None = None
    if fields.get("assumes_steps"):
        try:
            steps = int(fields["assumes_steps"])
        except ValueError:
            raise ApiError(400, "invalid_request", "assumes_steps: not an integer", param="assumes_steps") from None
        if steps <= 0:
            raise ApiError(400, "invalid_request", "assumes_steps: must be > 0", param="assumes_steps")
    data = await upload.read()
    try:
        return await asyncio.to_thread(
            registry.add_bytes, upload.filename or "", data, name=fields.get("name") or None,
            assumes_loop=fields.get("assumes_loop") or None, assumes_steps=steps,
        )
    except (AdapterFileError, AdapterError) as exc:
        info = exc.info()
        raise ApiError(400, info["type"], info["message"], param=info["param"]) from None


def _allowed_methods(app: FastAPI, scope: Any) -> list[str]:
    """Every method some route accepts on this path (a 405's ``Allow`` header)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def create_app(
    engine: Engine,
    config: DeployConfig,
    *,
    extension_schemas: Mapping[str, type[BaseModel]] | None = None,
    data_dir_lock: DataDirLock | None = None,
) -> FastAPI:
    """The video API over ``engine``. The app's lifespan starts and stops the engine.

    The app holds the exclusive lock of its data dir (``config.output_dir``) until its lifespan
    ends: ``data_dir_lock`` when the caller took it already (``fv serve`` does, before it loads
    any model), else it takes it here and raises :class:`DataDirInUse` naming the holder's pid.

    ``extension_schemas`` maps an extension the deploy config enables to the pydantic
    model of its per-request parameters; by default each enabled interceptor's
    ``request_model`` (the engine validates them again when the request is submitted).
    """
    if extension_schemas is None:
        extension_schemas = {pid: i.request_model for pid, i in engine.extensions.interceptors.items()}
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if data_dir_lock is None:
        # One server per data dir: a second one would resume (and rewrite) the first's live jobs.
        data_dir_lock = DataDirLock(output_dir).acquire()
    try:
        store = JobStore(config.server.db_path or output_dir / "jobs.sqlite3")
    except BaseException:
        data_dir_lock.release()
        raise
    rejections: Counter[str] = Counter()
    json_limits = JsonLimits.from_server(config.server)
    max_pixels = config.server.max_image_pixels
    manager = JobManager(
        engine, store, output_dir,
        enabled_extensions=config.extensions, extension_schemas=extension_schemas or {},
        rejections=rejections,
        checkpoint_every_steps=config.server.checkpoint_every_steps,
        checkpoint_max_bytes=config.server.checkpoint_max_bytes,
        finished_history_bytes=config.server.finished_history_bytes,
    )
    heartbeat_s = config.server.sse_heartbeat_s

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await manager.start()
            yield
        finally:
            await manager.stop()
            store.close()
            data_dir_lock.release()

    # Swagger UI at /docs (its scripts come from a CDN; the page itself is served offline too).
    app = FastAPI(title="fv video API", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None)
    install_openapi(app)
    metrics_registry = ServingMetrics(engine, rejections, store.counts_by_status)
    app.state.metrics = metrics_registry
    auth = config.api_key is not None
    app.state.manager = manager
    app.state.store = store
    app.state.engine = engine
    #: Called by the server (fv_kernel.serving.server) when a graceful stop begins, before it waits
    #: for connections: ends attached event streams with server.shutdown and suspends running jobs.
    app.state.drain = manager.drain

    # -- errors: always {"error": {...}}, a 4xx for anything the caller did -------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        rejections["body_too_large"] += 1
        return JSONResponse(error_body("body_too_large", str(exc)), status_code=413)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = from_validation_errors(list(exc.errors()))
        rejections[error.error_type] += 1
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        if exc.status_code == 405:
            # Starlette names only the first route matching the path; a path can have several (GET and POST /v1/videos).
            allowed = _allowed_methods(app, request.scope)
            headers["Allow"] = ", ".join(allowed)
            message = f"method {request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}"
        return JSONResponse(error_body(kind, message), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body("internal_error", f"{type(exc).__name__}: {exc}"), status_code=500)

    # -- videos -------------------------------------------------------------------------
    @app.post(
        "/v1/videos", response_model=VideoJob, openapi_extra=request_body(VideoCreate, form=True),
        responses=error_responses(400, 404, 413, 415, 429, auth=auth),
    )
    async def create_video(request: Request) -> VideoJob:
        try:
            body, encoded_image = await _read_video_create(request, json_limits)
        except ApiError as exc:
            raise manager.reject(exc) from None
        image = None
        if encoded_image is not None:
            _check_image_task(manager, body)  # before a byte of the image is read
            try:
                image = await asyncio.to_thread(_load_image, encoded_image, max_pixels=max_pixels)
            except ApiError as exc:
                raise manager.reject(exc) from None
        return manager.create_video(body, image)

    @app.get("/v1/videos", response_model=VideoList, responses=error_responses(400, 404, auth=auth))
    async def list_videos(
        limit: int = Query(default=20, ge=1, le=100),
        after: str | None = Query(default=None, pattern=JOB_ID_PATTERN.pattern, description="the last id of the previous page"),
        order: Literal["asc", "desc"] = Query(default="desc"),
    ) -> VideoList:
        if after is not None:
            manager.check_id(after)
        try:
            rows, has_more = store.page(limit=limit, after=after, order=order)
        except KeyError:
            raise ApiError(404, "not_found", f"after: no video job {after!r}", param="after") from None
        data = [manager.view(manager.record(row.id)) for row in rows]
        return VideoList(
            data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=has_more,
        )

    @app.get("/v1/videos/{video_id}", response_model=VideoJob, responses=error_responses(400, 404, auth=auth))
    async def get_video(video_id: str) -> VideoJob:
        return manager.view(manager.record(video_id))

    @app.get(
        "/v1/videos/{video_id}/content", response_class=FileResponse,
        responses={
            200: {"description": "The MP4 (variant=video) or the first frame as PNG (variant=thumbnail)", "content": {
                "video/mp4": {"schema": {"type": "string", "format": "binary"}},
                "image/png": {"schema": {"type": "string", "format": "binary"}},
            }},
            **error_responses(400, 404, 409, auth=auth),
        },
    )
    async def video_content(video_id: str, variant: ContentVariant = Query(default="video")) -> FileResponse:
        path, media_type = manager.content_path(video_id, variant)
        return FileResponse(path, media_type=media_type)

    @app.post("/v1/videos/{video_id}/cancel", response_model=VideoJob, responses=error_responses(400, 404, 409, auth=auth))
    async def cancel_video(video_id: str) -> VideoJob:
        return manager.cancel(video_id)

    @app.delete("/v1/videos/{video_id}", response_model=DeletedVideo, responses=error_responses(400, 404, auth=auth))
    async def delete_video(video_id: str) -> DeletedVideo:
        await manager.delete(video_id)
        return DeletedVideo(id=video_id)

    @app.get(
        "/v1/videos/{video_id}/events", response_class=StreamingResponse,
        responses={
            200: {"description": "The job's server-sent events (see docs/serving.md)",
                  "content": {"text/event-stream": {"schema": sse_event_schema()}}},
            **error_responses(400, 404, auth=auth),
        },
    )
    async def video_events(video_id: str, request: Request) -> StreamingResponse:
        manager.record(video_id)  # 400/404 before the stream starts
        after = -1
        last_id = request.headers.get("last-event-id")
        if last_id is not None:
            try:
                after = int(last_id)
            except ValueError:
                raise ApiError(400, "invalid_request", "Last-Event-ID: not an integer", param="Last-Event-ID") from None

        async def body() -> AsyncIterator[bytes]:
            async for item in manager.stream(video_id, after=after, heartbeat_s=heartbeat_s):
                yield _encode_sse(item)

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- images -------------------------------------------------------------------------
    @app.post(
        "/v1/images/generations", response_model=ImagesResponse, openapi_extra=request_body(ImageGenerate, form=False),
        responses=error_responses(400, 404, 413, 415, 429, 499, 500, 503, auth=auth),
    )
    async def generate_images(request: Request) -> ImagesResponse:
        content_type = _content_type(request)
        try:
            if content_type not in ("application/json", ""):
                raise ApiError(415, "unsupported_media_type", f"content type {content_type!r}; allowed: application/json")
            body = _validate(ImageGenerate, await _read_json_object(request, json_limits), strict=True)
        except ApiError as exc:
            raise manager.reject(exc) from None
        try:
            # A client that hangs up cancels its images at the next step boundary.
            return await manager.generate_images(body, disconnected=request.is_disconnected)
        except ClientDisconnected as exc:
            rejections["client_disconnected"] += 1
            return JSONResponse(error_body("client_disconnected", str(exc)), status_code=499)

    # -- adapters -----------------------------------------------------------------------
    @app.get("/v1/adapters", response_model=AdapterList, responses=error_responses(auth=auth))
    async def list_adapters() -> AdapterList:
        """The registered adapters (empty when the deployment has no ``adapters:`` section)."""
        registry = engine.adapters
        return AdapterList(data=[_adapter_object(info) for info in registry.list()] if registry is not None else [])

    @app.post(
        "/v1/adapters", response_model=AdapterObject, responses=error_responses(400, 413, 415, auth=auth),
        openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {
                "file": {"type": "string", "format": "binary", "description": "a .safetensors LoRA"},
                "name": {"type": "string", "description": "default: the file name's stem"},
                "assumes_loop": {"type": "string", "description": "a distilled adapter's loop id"},
                "assumes_steps": {"type": "string", "pattern": "^[0-9]{1,6}$", "description": "a distilled adapter's step count"},
            },
        }}}}},
    )
    async def upload_adapter(request: Request) -> AdapterObject:
        registry = engine.adapters
        try:
            if registry is None:
                raise ApiError(
                    400, "adapters_disabled",
                    "adapters are off in this deployment; enable them with the deploy config's 'adapters:' section",
                    param="adapters",
                )
            info = await _upload_adapter(request, registry)
        except ApiError as exc:
            raise manager.reject(exc) from None
        log.info("adapter %r registered from an upload (version %s, %d bytes)", info.name, info.version, info.size_bytes)
        return _adapter_object(info)

    # -- service ------------------------------------------------------------------------
    @app.get("/v1/models", response_model=ModelList, responses=error_responses(auth=auth))
    async def list_models() -> ModelList:
        now = int(time.time())
        data = []
        for model_id, instance in sorted(engine.instances.items()):
            caps = instance.card.capabilities
            data.append(ModelInfo(
                id=model_id, created=now, tasks=sorted(t.value for t in caps.tasks),
                defaults=caps.defaults.model_dump(mode="json") if caps.defaults else None,
            ))
        return ModelList(data=data)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok", "models": sorted(engine.instances), "queue_depth": engine.queue_depth(),
            "running": engine.running_count(),
        }

    @app.get(
        "/metrics", response_class=PlainTextResponse,
        responses={
            200: {"description": "Prometheus text exposition (OpenMetrics when the Accept header asks for it)",
                  "content": {"text/plain": {"schema": {"type": "string"}}}},
            **error_responses(auth=auth),
        },
    )
    async def metrics(request: Request) -> Response:
        body, content_type = metrics_registry.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    # Realtime sessions (docs/realtime.md): WebSocket, SSE fallback and the /realtime page.
    mount_realtime(app, engine.open_session, models=lambda: sorted(engine.instances), api_key=config.api_key,
                   heartbeat_s=heartbeat_s)

    # Plugins' routes (fv_serving_routes) go in last, so the kernel's routes win any clash;
    # the middleware below wraps them as it wraps the kernel's.
    mount_plugin_routes(app, engine, config)

    # Each add_middleware wraps the previous: auth runs before anything reads the body, and the
    # latency histogram (outermost) sees every answer, refusals included.
    upload_cap = (engine.adapters.settings.max_file_bytes + _UPLOAD_OVERHEAD_BYTES) if engine.adapters is not None else None
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.server.max_body_bytes, rejections=rejections,
        path_limits={("POST", "/v1/adapters"): upload_cap} if upload_cap is not None else None,
    )
    app.add_middleware(AuthMiddleware, api_key=config.api_key, open_paths=OPEN_PATHS, rejections=rejections)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics_registry)
    return app
