"""A realtime session's request: what a client opens a session with (design §12)."""

from __future__ import annotations

import uuid
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fv_kernel.errors import FvError, InvalidRequest

__all__ = ["MAX_PROMPT_CHARS", "CancelScope", "CANCEL_SCOPES", "SessionClosed", "SessionRequest", "check_cancel_scope"]

#: What a cancel ends. ``stream``: the not-yet-emitted chunk is abandoned and the session
#: continues with fresh chunks; ``session`` (also ``request``/``loop``: a session is one
#: request running one loop): the session ends.
CancelScope = Literal["request", "loop", "stream", "session"]
CANCEL_SCOPES: tuple[str, ...] = get_args(CancelScope)
#: The longest prompt (opening or update) a session accepts, in characters.
MAX_PROMPT_CHARS = 4096


class SessionClosed(FvError):
    """An operation on a session that has ended (a prompt update after stop, a second suspend)."""

    error_type = "session_closed"

    def __init__(self, session_id: str, reason: str, operation: str) -> None:
        super().__init__(f"session {session_id!r} has ended ({reason}); {operation} is not possible", param="session_id")
        self.session_id = session_id
        self.reason = reason


def check_cancel_scope(scope: str) -> CancelScope:
    """``scope`` as a :data:`CancelScope`, or a typed error naming the allowed scopes."""
    if scope not in CANCEL_SCOPES:
        raise InvalidRequest("scope", f"unknown cancel scope {scope!r}", allowed=CANCEL_SCOPES)
    return scope  # type: ignore[return-value]


class SessionRequest(BaseModel):
    """Open a streaming session on a causal card."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=128)
    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    seed: int = Field(default=0, ge=0, lt=2**63)
    #: Frame size in pixels; None: the card's default.
    height: int | None = Field(default=None, gt=0, le=4096)
    width: int | None = Field(default=None, gt=0, le=4096)
    #: Playback rate of the stream; None: the card's default.
    fps: float | None = Field(default=None, gt=0, le=240)
    #: Stop after this many chunks; None: run until stopped (or idle).
    max_chunks: int | None = Field(default=None, ge=1)
    #: End the session after this many seconds without a client message (push_text, touch).
    idle_timeout_s: float = Field(default=60.0, gt=0)
    #: How many chunks the session may run ahead of its slowest listener (chunks emitted but not
    #: yet taken from ``events()``); beyond it the session pauses between steps (backpressure).
    max_ahead_chunks: int = Field(default=2, ge=1, le=64)
    #: Emit media.chunk events (off: only session events, e.g. a client that polls state).
    stream: bool = True
    #: Also emit preview chunks when the card makes them.
    previews: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("prompt must not be blank")
        return value

    @classmethod
    def of(cls, **fields: Any) -> "SessionRequest":
        """Validate ``fields``; a bad one raises :class:`InvalidRequest` naming it (not a pydantic dump)."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or "session"
            raise InvalidRequest(param, first["msg"]) from None
