"""The wire schemas of the video API. Every request schema forbids unknown fields."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "VideoCreate",
    "ImageGenerate",
    "JobError",
    "ErrorDetail",
    "ErrorResponse",
    "VideoJob",
    "VideoList",
    "DeletedVideo",
    "ImageData",
    "ImagesResponse",
    "ModelInfo",
    "ModelList",
    "AdapterUse",
    "AdapterObject",
    "AdapterList",
    "parse_size",
    "JOB_STATUSES",
    "TERMINAL_STATUSES",
    "JOB_ID_PATTERN",
    "ContentVariant",
    "SSE_EVENTS",
    "sse_event_schema",
]

JobStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
JOB_STATUSES: tuple[str, ...] = ("queued", "in_progress", "completed", "failed", "cancelled")
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
#: Server-generated ids only; anything else is refused before it touches the store or disk.
JOB_ID_PATTERN = re.compile(r"^video_[0-9a-f]{32}$")

#: ``GET /v1/videos/{id}/content?variant=``: the MP4, or its first frame as PNG.
ContentVariant = Literal["video", "thumbnail"]
#: The names of the events ``GET /v1/videos/{id}/events`` streams.
SSE_EVENTS: tuple[str, ...] = (
    "video.queued", "video.started", "video.progress", "video.preview", "video.artifact",
    "video.completed", "video.failed", "video.cancelled", "server.shutdown",
)


def sse_event_schema() -> dict[str, Any]:
    """One server-sent event of ``GET /v1/videos/{id}/events`` (OpenAPI 3.1: the ``schema`` of an
    event stream describes each event). ``data`` is JSON text; ``server.shutdown`` has no ``id``."""
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string", "enum": list(SSE_EVENTS)},
            "data": {"type": "string", "contentMediaType": "application/json"},
            "id": {"type": "string", "pattern": "^[0-9]+$"},
        },
    }


# Absolute sanity bounds; the deployment's `limits:` and the card are the real caps.
_MAX_SIDE = 16384
_MAX_FRAMES = 100_000
_MAX_STEPS = 10_000
_SIZE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` -> (width, height); raises ValueError naming the expected form."""
    match = _SIZE.match(size.strip())
    if match is None:
        raise ValueError(f"size {size!r} is not WIDTHxHEIGHT (e.g. 832x480)")
    width, height = int(match.group(1)), int(match.group(2))
    if not (0 < width <= _MAX_SIDE and 0 < height <= _MAX_SIDE):
        raise ValueError(f"size {size!r}: width and height must be between 1 and {_MAX_SIDE}")
    return width, height


_ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class AdapterUse(BaseModel):
    """One adapter of a request's stack: a registered name (``GET /v1/adapters``) at a strength."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=_ADAPTER_NAME, description="a registered adapter (GET /v1/adapters)")
    scale: float = Field(default=1.0, ge=-100, le=100, description="strength (ComfyUI's strength_model)")


class _Generation(BaseModel):
    # JSON values must have the document's types ("exact": 0, "guidance": false are refused);
    # form fields are text and are validated with strict=False (fv_kernel.serving.app).
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(default=None, min_length=1, description="card id; omitted: the only resident card")
    prompt: str = Field(min_length=1, max_length=20_000)
    negative_prompt: str | None = Field(default=None, max_length=20_000)
    size: str | None = Field(
        default=None, pattern=_SIZE.pattern, description="WIDTHxHEIGHT, e.g. 832x480; omitted: the card's default",
    )
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="omitted: a random seed, reported on the job")
    steps: int | None = Field(default=None, gt=0, le=_MAX_STEPS)
    guidance: float | None = Field(default=None, ge=0, le=100)
    #: Parameters for plugins the deployment enabled (its ``extensions:``), validated by their schema.
    extensions: dict[str, dict[str, Any]] = Field(default_factory=dict)
    adapters: list[AdapterUse] = Field(
        default_factory=list, max_length=64,
        description="LoRA adapters to apply, in order, after the card's default stack (docs/adapters.md); requests with "
                    "different adapters still share a batched forward",
    )
    exact: bool = Field(
        default=False,
        description="bit-identical to this request run alone: its rows never share a fused call with other requests'",
    )
    allow_outside_envelope: bool = Field(
        default=False,
        description="run outside the card's trained envelope (frames, size, fps, prompt words) instead of being "
                    "refused; the server logs a warning",
    )
    priority: Literal["interactive", "batch"] = Field(
        default="interactive",
        description="scheduling class: an interactive request's steps run before batch-class ones unless those waited "
                    "longer than scheduler.batch.batch_class_max_wait_s",
    )


#: ``seconds`` as text, as OpenAI's SDK sends it (``"4"``); JSON is otherwise strictly typed.
_SECONDS_TEXT = r"^[0-9]{1,4}(\.[0-9]{1,6})?$"


def _seconds_as_text(schema: dict[str, Any]) -> None:
    schema["properties"]["seconds"]["anyOf"].insert(1, {"type": "string", "pattern": _SECONDS_TEXT})


class VideoCreate(_Generation):
    """``POST /v1/videos`` (JSON, or the same fields as multipart form fields)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_seconds_as_text)

    seconds: float | None = Field(
        default=None, gt=0, le=3600,
        description="duration (the OpenAI SDK sends \"4\", \"8\" or \"12\"); converted to the frame count the card "
                    "makes at fps, or refused with the durations it can make",
    )
    frames: int | None = Field(default=None, gt=0, le=_MAX_FRAMES)
    fps: float | None = Field(default=None, gt=0, le=240)
    #: The first frame for image-to-video: base64 (optionally a data: URL) in JSON, a file in multipart.
    input_reference: str | None = None

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_text(cls, value: Any) -> Any:
        if isinstance(value, str) and re.fullmatch(_SECONDS_TEXT, value):
            return float(value)
        return value


class ImageGenerate(_Generation):
    """``POST /v1/images/generations``, OpenAI-images-shaped."""

    n: int = Field(default=1, ge=1, le=8)
    response_format: Literal["b64_json"] = "b64_json"


class JobError(BaseModel):
    """Why a job failed or was cancelled; ``code`` repeats ``type`` as OpenAI's video object names it."""

    type: str
    message: str
    param: str | None = None
    code: str | None = None

    @model_validator(mode="after")
    def _code_is_type(self) -> "JobError":
        if self.code is None:
            self.code = self.type
        return self


class ErrorDetail(BaseModel):
    """One refusal, in OpenAI's error shape (``code`` repeats fv's precise ``type``)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer."""

    error: ErrorDetail


class VideoJob(BaseModel):
    """A video job as the API reports it (OpenAI's video object plus fv's generation settings)."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: JobStatus
    progress: int = Field(ge=0, le=100)
    created_at: int
    started_at: int | None = None
    completed_at: int | None = None
    expires_at: int | None = None
    error: JobError | None = None
    prompt: str
    task: str
    size: str
    seconds: str
    frames: int
    fps: float
    steps: int | None
    guidance: float | None
    seed: int


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedVideo(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


class ModelInfo(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fv"
    tasks: list[str]
    defaults: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfo]


class AdapterObject(BaseModel):
    """One registered adapter version (``GET /v1/adapters``, ``POST /v1/adapters``). The server's file
    paths are not shown."""

    object: Literal["adapter"] = "adapter"
    name: str
    version: str = Field(description="the content version: 16 hex digits of a sha256 over the file and what it converts to")
    size_bytes: int
    components: list[str] = Field(description="the card components it changes (transformer, text_encoder, ...)")
    rank: int = Field(description="its largest LoRA rank (0: full deltas only)")
    weight_bytes: int
    assumes_loop: str | None = None
    assumes_steps: int | None = None
    source: Literal["file", "directory", "upload"]


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterObject]
