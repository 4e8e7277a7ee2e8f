"""The session event types and the media.chunk validators (docs/realtime.md, "Events"): invalid
combinations cannot be built; the session request and the realtime loop records validate their fields."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from fv_kernel.api import (
    CANCEL_SCOPES,
    ChunkRolloutState,
    ErrorInfo,
    Event,
    InvalidRequest,
    MediaChunk,
    ReadyChunk,
    SessionClosedEvent,
    SessionRequest,
    check_cancel_scope,
)

FRAMES = torch.rand(3, 3, 4, 4)


def chunk(**fields: Any) -> MediaChunk:
    base: dict[str, Any] = dict(request_id="s", stream="video", index=0, preview=False, frames=FRAMES,
                                frame_start=6, num_frames=3, fps=12.0, pts=(0.5, 0.75), prompt_version=2)
    base.update(fields)
    return MediaChunk(**base)


def test_a_final_video_chunk_with_a_consistent_frame_range_pts_and_fps_is_accepted() -> None:
    event = chunk()
    assert (event.frame_start, event.num_frames, event.prompt_version) == (6, 3, 2)
    parsed = TypeAdapter(Event).validate_python(event.model_dump())
    assert isinstance(parsed, MediaChunk) and parsed.pts == (0.5, 0.75)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"frame_start": None, "num_frames": None}, "needs its frame range"),
        ({"num_frames": None}, "come together"),
        ({"frame_start": None}, "come together"),
        ({"num_frames": 2}, "frames hold 3"),
        ({"pts": (0.5, 1.0)}, "does not match frames"),
        ({"pts": (0.0, 0.25)}, "does not match frames"),
        ({"fps": 24.0}, "does not match frames"),
        ({"fps": None}, "needs fps"),
        ({"frames": None, "text": "hi"}, "describe frames"),
        ({"frames": None}, "exactly one of"),
        ({"index": -1}, "greater than or equal"),
        ({"prompt_version": -1}, "greater than or equal"),
    ],
)
def test_invalid_media_chunk_combinations_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        chunk(**fields)


def test_a_preview_chunk_may_omit_its_frame_range_and_a_text_chunk_carries_none() -> None:
    preview = chunk(preview=True, frame_start=None, num_frames=None, fps=None, pts=(0.0, 0.1), prompt_version=None)
    assert preview.frame_start is None
    text = MediaChunk(request_id="r", stream="text", index=0, pts=(0, 0), preview=False, text="tok")
    assert text.num_frames is None


def test_session_events_parse_from_the_event_union() -> None:
    adapter = TypeAdapter(Event)
    for data in (
        {"type": "session.started", "request_id": "s", "model": "m", "fps": 16.0, "height": 64, "width": 64},
        {"type": "session.prompt_queued", "request_id": "s", "version": 1, "event_id": "e"},
        {"type": "session.prompt_applied", "request_id": "s", "version": 1, "chunk_index": 3},
        {"type": "session.suspended", "request_id": "s", "chunk_index": 3, "nbytes": 10},
        {"type": "session.resumed", "request_id": "s", "chunk_index": 3, "prompt_version": 1},
        {"type": "session.error", "request_id": "s", "error": {"type": "invalid_request", "message": "m", "param": "scope"}},
        {"type": "session.closed", "request_id": "s", "reason": "idle_timeout", "chunks": 4},
    ):
        assert adapter.validate_python(data).type == data["type"]
    with pytest.raises(ValidationError):
        adapter.validate_python({"type": "session.closed", "request_id": "s", "reason": "exploded", "chunks": 1})
    with pytest.raises(ValidationError):
        adapter.validate_python({"type": "session.prompt_queued", "request_id": "s", "version": 0})


def test_session_closed_carries_an_error_exactly_when_it_failed() -> None:
    error = ErrorInfo(type="step_failed", message="boom")
    assert SessionClosedEvent(request_id="s", reason="failed", chunks=1, error=error).error == error
    with pytest.raises(ValidationError, match="exactly when"):
        SessionClosedEvent(request_id="s", reason="failed", chunks=1)
    with pytest.raises(ValidationError, match="exactly when"):
        SessionClosedEvent(request_id="s", reason="stopped", chunks=1, error=error)


def test_session_request_and_cancel_scopes_validate_with_typed_errors() -> None:
    assert SessionRequest.of(model="m", prompt="p").idle_timeout_s == 60.0
    for fields, param in (
        ({"prompt": "  "}, "prompt"),
        ({"prompt": "p", "fps": 0}, "fps"),
        ({"prompt": "p", "idle_timeout_s": -1}, "idle_timeout_s"),
        ({"prompt": "p", "height": 10_000}, "height"),
        ({"prompt": "p", "colour": "red"}, "colour"),
    ):
        with pytest.raises(InvalidRequest) as err:
            SessionRequest.of(model="m", **fields)
        assert err.value.param == param
    assert CANCEL_SCOPES == ("request", "loop", "stream", "session")
    assert check_cancel_scope("stream") == "stream"
    with pytest.raises(InvalidRequest) as err:
        check_cancel_scope("all")
    assert err.value.param == "scope" and "session" in err.value.message


def test_ready_chunk_and_rollout_state_validate() -> None:
    assert ReadyChunk(chunk_index=0, frames=FRAMES, frame_start=0, prompt_version=0).num_frames == 3
    with pytest.raises(ValidationError, match=r"\[F>=1, 3, H, W\]"):
        ReadyChunk(chunk_index=0, frames=torch.rand(3, 4, 4), frame_start=0, prompt_version=0)
    with pytest.raises(ValidationError, match="floating point"):
        ReadyChunk(chunk_index=0, frames=torch.zeros(1, 3, 2, 2, dtype=torch.uint8), frame_start=0, prompt_version=0)
    state = ChunkRolloutState(request_id="s", loop_id="l", instance_id="i", prompt="p", fps=8.0,
                              ready=[ReadyChunk(chunk_index=0, frames=FRAMES, frame_start=0, prompt_version=0)])
    back = ChunkRolloutState.from_bytes(state.to_bytes())
    assert torch.equal(back.ready[0].frames, FRAMES), "ready chunks serialize with the state"
    with pytest.raises(ValidationError):
        ChunkRolloutState(request_id="s", loop_id="l", instance_id="i", prompt="p", fps=0.0)


def test_the_rollout_contract_defaults_queue_apply_and_drain() -> None:
    from fv_kernel.api import ChunkRolloutLoop, LoopSpec

    class Bare(ChunkRolloutLoop[ChunkRolloutState]):
        state_type = ChunkRolloutState
        init = next = advance = finalize = None  # type: ignore[assignment]

    Bare.__abstractmethods__ = frozenset()
    loop = Bare(LoopSpec(loop_id="roll", kind="chunk_rollout", implementation="x:y"))
    assert loop.kind == "chunk_rollout"
    state = ChunkRolloutState(request_id="s", loop_id="roll", instance_id="i", prompt="a", fps=8.0)
    state = loop.update_prompt(state, "b", 1)
    assert (state.prompt, state.pending_prompt, state.pending_version) == ("a", "b", 1), "queued, not applied"
    state = loop.update_prompt(state, "c", 2)
    assert state.pending_prompt == "c", "a newer update replaces a queued one"
    with pytest.raises(InvalidRequest):
        loop.update_prompt(state, "old", 2)
    state = loop.apply_pending_prompt(state)
    assert (state.prompt, state.prompt_version, state.pending_prompt) == ("c", 2, None)
    ready = [ReadyChunk(chunk_index=i, frames=FRAMES, frame_start=3 * i, prompt_version=2) for i in range(2)]
    state, taken = loop.take_ready(state.model_copy(update={"ready": ready}))
    assert len(taken) == 2 and state.ready == [] and state.frames_emitted == 6
    # A preview shows frames its final chunk will cover: taking it does not advance the timeline.
    preview = ReadyChunk(chunk_index=2, frames=FRAMES, frame_start=6, prompt_version=2, preview=True)
    state, taken = loop.take_ready(state.model_copy(update={"ready": [preview]}))
    assert taken == [preview] and state.frames_emitted == 6
    assert loop.cancel_stream(state.model_copy(update={"ready": ready})).ready == []
    assert loop.progress(state.model_copy(update={"chunk_index": 3, "max_chunks": 5})) == (3, 5)
    assert loop.finished(state.model_copy(update={"chunk_index": 5, "max_chunks": 5}))
    assert not loop.finished(state.model_copy(update={"chunk_index": 5}))
