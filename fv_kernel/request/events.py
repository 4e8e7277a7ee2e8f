"""The typed event stream of a request (design §12).

One ordered stream per request carries lifecycle, progress, media and artifact
events. Each event type is its own class, so invalid combinations (a preview chunk
with no stream, a failure with no error) cannot be constructed.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fv_kernel.request.artifacts import Artifact, BehaviorSlice

__all__ = [
    "ErrorInfo",
    "RequestQueued",
    "RequestStarted",
    "RequestCompleted",
    "RequestFailed",
    "RequestCancelled",
    "Progress",
    "MediaInit",
    "MediaChunk",
    "MediaComplete",
    "ArtifactReady",
    "BehaviorSliceReady",
    "Event",
    "TERMINAL_EVENT_TYPES",
]


class ErrorInfo(BaseModel):
    """A structured error: a machine-readable type, a message, and the offending field if any."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    message: str
    param: str | None = None


class _Event(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", frozen=True)

    request_id: str
    #: Position in the request's stream; assigned by the runtime, strictly increasing.
    seq: int = 0
    ts: float = Field(default_factory=time.time)


class RequestQueued(_Event):
    type: Literal["request.queued"] = "request.queued"


class RequestStarted(_Event):
    type: Literal["request.started"] = "request.started"


class RequestCompleted(_Event):
    type: Literal["request.completed"] = "request.completed"


class RequestFailed(_Event):
    type: Literal["request.failed"] = "request.failed"
    error: ErrorInfo


class RequestCancelled(_Event):
    type: Literal["request.cancelled"] = "request.cancelled"
    reason: str = "cancelled by caller"


class Progress(_Event):
    type: Literal["progress"] = "progress"
    loop_id: str
    step: int = Field(ge=0)
    total: int | None = Field(default=None, ge=0)


class MediaInit(_Event):
    type: Literal["media.init"] = "media.init"
    stream: str
    modality: Literal["video", "audio", "text"]
    fps: float | None = None
    sample_rate: int | None = None


class MediaChunk(_Event):
    """A piece of a media stream: decoded frames, audio samples or text."""

    type: Literal["media.chunk"] = "media.chunk"
    stream: str
    index: int = Field(ge=0)
    #: Timestamp range in seconds (start, end) that the chunk covers.
    pts: tuple[float, float]
    preview: bool
    frames: torch.Tensor | None = None
    samples: torch.Tensor | None = None
    text: str | None = None

    @model_validator(mode="after")
    def _one_payload(self) -> "MediaChunk":
        payloads = [p for p in (self.frames, self.samples, self.text) if p is not None]
        if len(payloads) != 1:
            raise ValueError("a media.chunk carries exactly one of frames, samples or text")
        if self.pts[1] < self.pts[0]:
            raise ValueError(f"media.chunk pts must be (start, end) with end >= start, got {self.pts}")
        return self


class MediaComplete(_Event):
    type: Literal["media.complete"] = "media.complete"
    stream: str


class ArtifactReady(_Event):
    type: Literal["artifact.ready"] = "artifact.ready"
    artifact: Artifact


class BehaviorSliceReady(_Event):
    """One captured denoise step (requests with ``output.capture_behavior``), emitted as the step finishes."""

    type: Literal["behavior.slice"] = "behavior.slice"
    loop_id: str
    slice: BehaviorSlice


Event = Annotated[
    Union[
        RequestQueued,
        RequestStarted,
        RequestCompleted,
        RequestFailed,
        RequestCancelled,
        Progress,
        MediaInit,
        MediaChunk,
        MediaComplete,
        ArtifactReady,
        BehaviorSliceReady,
    ],
    Field(discriminator="type"),
]

TERMINAL_EVENT_TYPES = frozenset({"request.completed", "request.failed", "request.cancelled"})
