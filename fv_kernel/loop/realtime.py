"""The realtime loop contract: a chunk rollout that a session drives (design §12).

A causal card streams video chunk after chunk. Its loop is an ordinary driven loop
(``next`` / ``advance`` / ``finalize``) whose state carries the fields the session
runtime needs: which chunk it is on, the prompt and its version, a queued prompt
update, and the decoded chunks not yet emitted. The runtime touches the loop only at
step boundaries, through :meth:`ChunkRolloutLoop.update_prompt`,
:meth:`ChunkRolloutLoop.take_ready`, :meth:`ChunkRolloutLoop.cancel_stream` and
:meth:`ChunkRolloutLoop.suspend`; everything per session lives in the state.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fv_kernel.errors import InvalidRequest
from fv_kernel.loop.contract import Loop, LoopContext, LoopState, ResidentModel
from fv_kernel.request.request import Request

__all__ = ["SESSION_UPSTREAM", "ChunkRolloutLoop", "ChunkRolloutState", "ReadyChunk"]

#: The ``ctx.upstream`` key under which the session runtime hands a rollout its session
#: settings (``{"max_chunks": int | None}``); :meth:`ChunkRolloutLoop.session_fields` reads it.
SESSION_UPSTREAM = "session"


class ReadyChunk(BaseModel):
    """One decoded chunk the runtime has not emitted yet."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    chunk_index: int = Field(ge=0)
    #: ``[F, 3, H, W]`` float frames in [0, 1].
    frames: torch.Tensor
    #: The chunk's first frame in the session's generated timeline.
    frame_start: int = Field(ge=0)
    #: The prompt version this chunk was generated under.
    prompt_version: int = Field(ge=0)
    #: An early look at chunk ``chunk_index`` (e.g. decoded from a denoise step's x0 estimate): it covers
    #: the frames its final version will, which follows it; previews never advance the timeline.
    preview: bool = False

    @field_validator("frames")
    @classmethod
    def _frames(cls, value: torch.Tensor) -> torch.Tensor:
        if value.ndim != 4 or value.shape[1] != 3 or value.shape[0] < 1:
            raise ValueError(f"ReadyChunk.frames must be [F>=1, 3, H, W], got {tuple(value.shape)}")
        if not value.is_floating_point():
            raise ValueError(f"ReadyChunk.frames must be floating point in [0, 1], got {value.dtype}")
        return value

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


class ChunkRolloutState(LoopState):
    """The kernel-known fields of every chunk-rollout loop's state. Cards subclass it."""

    #: Chunks finished (decoded) so far; the index of the chunk being generated.
    chunk_index: int = Field(default=0, ge=0)
    #: Stop after this many chunks; None: until the runtime stops the loop.
    max_chunks: int | None = Field(default=None, ge=1)
    #: The prompt the current chunk is generated under, and its version (0: the opening prompt).
    prompt: str
    prompt_version: int = Field(default=0, ge=0)
    #: A prompt update waiting for the next chunk boundary.
    pending_prompt: str | None = None
    pending_version: int | None = None
    #: Decoded chunks the runtime has not emitted yet.
    ready: list[ReadyChunk] = Field(default_factory=list)
    #: Frames the runtime has emitted (the next emitted chunk's first frame).
    frames_emitted: int = Field(default=0, ge=0)
    fps: float = Field(gt=0)


S = TypeVar("S", bound=ChunkRolloutState)


class ChunkRolloutLoop(Loop[S]):
    """A causal card's streaming loop (kind ``"chunk_rollout"``).

    ``next`` keeps producing plans chunk after chunk (text encode when the prompt
    changed, the denoise steps, the KV refresh, the chunk decode) until ``max_chunks``
    or until the runtime stops it; ``advance`` appends a :class:`ReadyChunk` to
    ``state.ready`` when a chunk is decoded and, at that boundary, calls
    :meth:`apply_pending_prompt`. The session runtime calls the other methods here
    between steps; none of them runs a kernel.
    """

    kind: ClassVar[str] = "chunk_rollout"

    def session_fields(self, request: Request, ctx: LoopContext) -> dict[str, Any]:
        """The kernel fields of a fresh state (prompt, max_chunks, fps) for ``init`` to splat in.

        ``prompt`` is the request's prompt, ``fps`` its (resolved) fps, ``max_chunks`` the
        session's (``ctx.upstream[SESSION_UPSTREAM]``; None outside a session).
        """
        session = ctx.upstream.get(SESSION_UPSTREAM) or {}
        fps = request.diffusion.fps
        if fps is None:
            raise InvalidRequest("fps", "a chunk rollout needs the request's fps (resolve the request against its card)")
        return {"prompt": request.text() or "", "max_chunks": session.get("max_chunks"), "fps": float(fps)}

    def update_prompt(self, state: S, prompt: str, version: int) -> S:
        """Queue ``prompt`` (as ``version``) for the next chunk boundary; a newer update replaces a queued one."""
        if version <= state.prompt_version or (state.pending_version is not None and version <= state.pending_version):
            raise InvalidRequest(
                "version", f"prompt version {version} is not newer than the state's "
                f"(current {state.prompt_version}, queued {state.pending_version})",
            )
        return state.model_copy(update={"pending_prompt": prompt, "pending_version": version})

    def apply_pending_prompt(self, state: S) -> S:
        """The state with a queued prompt made current. Loops call it only at a chunk boundary."""
        if state.pending_prompt is None or state.pending_version is None:
            return state
        return state.model_copy(update={
            "prompt": state.pending_prompt, "prompt_version": state.pending_version,
            "pending_prompt": None, "pending_version": None,
        })

    def take_ready(self, state: S) -> tuple[S, list[ReadyChunk]]:
        """The decoded chunks to emit, and the state without them (``frames_emitted`` advanced by the
        final chunks: a preview shows frames its chunk's final version will cover)."""
        if not state.ready:
            return state, []
        chunks = list(state.ready)
        emitted = state.frames_emitted + sum(chunk.num_frames for chunk in chunks if not chunk.preview)
        return state.model_copy(update={"ready": [], "frames_emitted": emitted}), chunks

    def cancel_stream(self, state: S) -> S:
        """Abandon what is not emitted yet (``scope="stream"``) and continue with a fresh chunk.

        The default drops the decoded chunks not yet taken; a loop that is part-way
        through a chunk overrides it to restart that chunk too.
        """
        return state.model_copy(update={"ready": []})

    def suspend(self, state: S, ctx: LoopContext) -> S:
        """A self-contained copy of ``state`` for serialization (pool-resident K/V copied in).

        :meth:`Loop.restore` re-acquires what this copied out. The default returns
        the state unchanged: right for a loop that keeps nothing outside its state.
        """
        return state

    def release(self, owner: str, model: ResidentModel) -> None:
        """Free what ``owner`` (the session's request id) holds outside its state, e.g. its pool slabs.

        The session runtime calls it once when the session ends for any reason (completed,
        stopped, failed, suspended: a suspended state carries its own copy). Default: nothing.
        """

    def progress(self, state: S) -> tuple[int, int | None]:
        return state.chunk_index, state.max_chunks

    def finished(self, state: S) -> bool:
        """Whether the rollout has produced all its chunks (``max_chunks`` reached)."""
        return state.max_chunks is not None and state.chunk_index >= state.max_chunks

