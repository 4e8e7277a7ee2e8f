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
    "SessionStarted",
    "SessionPromptQueued",
    "SessionPromptApplied",
    "SessionSuspended",
    "SessionResumed",
    "SessionError",
    "SessionCloseReason",
    "SessionClosedEvent",
    "SESSION_TERMINAL_EVENT_TYPES",
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
    """A piece of a media stream: decoded frames, audio samples or text.

    A final (non-preview) video chunk carries its frame range (``frame_start``,
    ``num_frames``) and ``fps``, and its ``pts`` is that range in seconds; a session's
    chunks also carry the ``prompt_version`` they were generated under. Combinations
    that contradict each other are refused when the event is built.
    """

    type: Literal["media.chunk"] = "media.chunk"
    stream: str
    index: int = Field(ge=0)
    #: Timestamp range in seconds (start, end) that the chunk covers.
    pts: tuple[float, float]
    preview: bool
    frames: torch.Tensor | None = None
    samples: torch.Tensor | None = None
    text: str | None = None
    #: The chunk's frames in the stream's timeline: ``[frame_start, frame_start + num_frames)``.
    frame_start: int | None = Field(default=None, ge=0)
    num_frames: int | None = Field(default=None, ge=1)
    #: The stream's frame rate (``pts`` = frame range / fps when both are given).
    fps: float | None = Field(default=None, gt=0)
    #: The session prompt version the chunk was generated under (session streams).
    prompt_version: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_payload(self) -> "MediaChunk":
        payloads = [p for p in (self.frames, self.samples, self.text) if p is not None]
        if len(payloads) != 1:
            raise ValueError("a media.chunk carries exactly one of frames, samples or text")
        if self.pts[1] < self.pts[0]:
            raise ValueError(f"media.chunk pts must be (start, end) with end >= start, got {self.pts}")
        ranged = (self.frame_start is not None, self.num_frames is not None)
        if ranged[0] != ranged[1]:
            raise ValueError("media.chunk frame_start and num_frames come together (a frame range), or neither")
        if self.frames is None:
            if ranged[0] or self.prompt_version is not None:
                raise ValueError("media.chunk frame_start/num_frames/prompt_version describe frames; this chunk has none")
            return self
        if not self.preview and not ranged[0]:
            raise ValueError("a final video media.chunk needs its frame range (frame_start, num_frames)")
        if ranged[0] and self.frames.ndim == 4 and self.frames.shape[0] != self.num_frames:
            raise ValueError(
                f"media.chunk num_frames={self.num_frames} but frames hold {self.frames.shape[0]} (frames are [F, 3, H, W])"
            )
        if ranged[0] and self.fps is None and not self.preview:
            raise ValueError("a final video media.chunk needs fps, so pts can be checked against its frame range")
        if ranged[0] and self.fps is not None:
            assert self.frame_start is not None and self.num_frames is not None
            want = (self.frame_start / self.fps, (self.frame_start + self.num_frames) / self.fps)
            if abs(self.pts[0] - want[0]) > 1e-6 or abs(self.pts[1] - want[1]) > 1e-6:
                raise ValueError(
                    f"media.chunk pts {self.pts} does not match frames [{self.frame_start}, "
                    f"{self.frame_start + self.num_frames}) at {self.fps:g} fps (expected {want})"
                )
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


class SessionStarted(_Event):
    """A session was admitted and its first chunk is being generated. ``request_id`` is the session id."""

    type: Literal["session.started"] = "session.started"
    model: str
    fps: float = Field(gt=0)
    height: int = Field(gt=0)
    width: int = Field(gt=0)
    max_chunks: int | None = Field(default=None, ge=1)


class SessionPromptQueued(_Event):
    """A prompt update was accepted; it applies at the next chunk boundary."""

    type: Literal["session.prompt_queued"] = "session.prompt_queued"
    event_id: str | None = None
    version: int = Field(ge=1)


class SessionPromptApplied(_Event):
    """A prompt update became current; ``chunk_index`` is the first chunk generated under it."""

    type: Literal["session.prompt_applied"] = "session.prompt_applied"
    version: int = Field(ge=1)
    chunk_index: int = Field(ge=0)


class SessionSuspended(_Event):
    """The session's state was serialized (``nbytes`` long); the session ends with reason ``suspended``."""

    type: Literal["session.suspended"] = "session.suspended"
    chunk_index: int = Field(ge=0)
    nbytes: int = Field(ge=0)


class SessionResumed(_Event):
    """A suspended session continues (maybe in another process) from ``chunk_index``."""

    type: Literal["session.resumed"] = "session.resumed"
    chunk_index: int = Field(ge=0)
    prompt_version: int = Field(ge=0)


class SessionError(_Event):
    """A client mistake or a recoverable fault; the session lives on (a fatal one is ``session.closed`` failed)."""

    type: Literal["session.error"] = "session.error"
    error: ErrorInfo
    event_id: str | None = None


SessionCloseReason = Literal["stopped", "idle_timeout", "completed", "failed", "cancelled", "suspended"]


class SessionClosedEvent(_Event):
    """The session ended; ``chunks`` were emitted. A failure carries its error."""

    type: Literal["session.closed"] = "session.closed"
    reason: SessionCloseReason
    chunks: int = Field(ge=0)
    error: ErrorInfo | None = None

    @model_validator(mode="after")
    def _error_iff_failed(self) -> "SessionClosedEvent":
        if (self.reason == "failed") != (self.error is not None):
            raise ValueError("session.closed carries an error exactly when its reason is 'failed'")
        return self


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
        SessionStarted,
        SessionPromptQueued,
        SessionPromptApplied,
        SessionSuspended,
        SessionResumed,
        SessionError,
        SessionClosedEvent,
    ],
    Field(discriminator="type"),
]

TERMINAL_EVENT_TYPES = frozenset({"request.completed", "request.failed", "request.cancelled"})

SESSION_TERMINAL_EVENT_TYPES = frozenset({"session.closed"})
