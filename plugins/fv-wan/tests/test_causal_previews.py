"""Preview chunks on ``wan-toy-causal``: a session that asks for previews gets, before each chunk, the
decode of that chunk's first denoise step's x0 estimate, with the final chunk's index and frame
range; the final chunks are bit-identical to a session without previews (the preview decode leaves
the stream's VAE cache alone). Over the WebSocket they are fv's ``video.preview`` messages, sent only
to a client that asked (``extra_params.previews``)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fv_wan.toy_card import wan_toy_causal_card

import fv_kernel as fv
from fv_kernel.api import DeployConfig, Engine, SchedulerConfig, build_instance

pytestmark = pytest.mark.skipif(wan_toy_causal_card() is None, reason="wan-toy-causal's weights are not installed")

PROMPT = "a red circle moves left quickly on a navy background"
CHUNKS = 3


def _session(previews: bool, **options: Any) -> list[fv.Chunk]:
    pipe = fv.load("wan-toy-causal")
    with pipe.session(PROMPT, seed=3, previews=previews, max_chunks=CHUNKS, **options) as session:
        return list(session)


def test_each_chunk_is_previewed_first_and_the_finals_do_not_change() -> None:
    plain = _session(previews=False)
    with_previews = _session(previews=True)
    assert not any(chunk.preview for chunk in plain) and len(plain) == CHUNKS
    assert [(c.index, c.preview) for c in with_previews] == [(i, p) for i in range(CHUNKS) for p in (True, False)]
    previews = [c for c in with_previews if c.preview]
    finals = [c for c in with_previews if not c.preview]
    for preview, final, alone in zip(previews, finals, plain):
        assert (preview.frame_start, preview.num_frames, preview.pts) == (final.frame_start, final.num_frames, final.pts)
        assert torch.equal(final.frames, alone.frames), "a preview must not change the stream (VAE cache, noise)"
        assert final.frame_start == alone.frame_start
        # An x0 estimate after one of four steps: the same scene, not yet the chunk.
        assert 0 < float((preview.frames - final.frames).abs().max()) < 1.0


def test_a_preview_decode_that_advanced_the_vae_cache_would_change_the_finals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: keep the preview decode's VAE cache (the bug the loop avoids) and the finals move."""
    from fv_wan import causal

    original = causal.CausalWanRolloutLoop.advance

    def advance_keeping_the_preview_cache(self: Any, state: Any, result: Any) -> Any:
        out = original(self, state, result)
        if state.phase == "preview":
            cache = {k[len("cache."):]: v for k, v in result.outputs.items() if k.startswith("cache.")}
            out = out.model_copy(update={"vae_cache": cache})
        return out

    plain = _session(previews=False)
    monkeypatch.setattr(causal.CausalWanRolloutLoop, "advance", advance_keeping_the_preview_cache)
    finals = [c for c in _session(previews=True) if not c.preview]
    assert any(not torch.equal(a.frames, b.frames) for a, b in zip(finals, plain))


def test_a_prompt_update_during_a_preview_restarts_the_chunk_under_it() -> None:
    """Driven step by step (the session runtime applies client messages between steps; when one lands
    relative to a preview is a race, so it is not left to one here)."""
    from test_causal_parity import make_request, tiny_instance

    from fv_kernel.api import Done, LoopContext, StepResult

    instance = tiny_instance()
    loop = instance.loop("realtime")
    request = make_request("wan-tiny-causal")
    ctx = LoopContext(request=request, executor=None)  # type: ignore[arg-type]
    state = loop.init(request, instance, ctx).model_copy(update={"previews": True})  # as in a session that asked
    while state.phase != "preview":
        plan = loop.next(state)
        assert not isinstance(plan, Done)
        state = loop.advance(state, StepResult(outputs=instance.op(plan.op).fn(plan.inputs, plan.params)))
    assert state.chunk_step == 1 and state.preview_x0 is not None
    updated = loop.update_prompt(state, "a blue ball", 1)
    assert (updated.phase, updated.chunk_step, updated.preview_x0, updated.prompt_version) == ("text", 0, None, 1)
    assert not torch.equal(updated.latents, state.latents), "the chunk restarts from fresh noise"
    # Negative control: with prompt_update "boundary" the preview and the chunk finish under the old prompt.
    loop._recipe = loop._recipe.model_copy(update={"prompt_update": "boundary"})
    kept = loop.update_prompt(state, "a blue ball", 1)
    assert (kept.phase, kept.prompt_version, kept.pending_version) == ("preview", 0, 1)


def test_a_generate_request_is_unaffected_by_previews() -> None:
    pipe = fv.load("wan-toy-causal")
    events = list(pipe.stream(PROMPT, seed=3, frames=9, previews=True))
    assert not any(getattr(e, "type", "") == "media.chunk" and e.preview for e in events)
    ref = pipe.generate(PROMPT, seed=3, frames=9)
    done = [e for e in events if getattr(e, "type", "") == "artifact.ready"]
    assert done and done[-1].artifact.frames.shape == ref.frames.shape


# -- the WebSocket -------------------------------------------------------------------------------
websockets_sync = pytest.importorskip("websockets.sync.client")
pytest.importorskip("httpx")
pytest.importorskip("av")


@pytest.fixture
def ws_url(tmp_path: Path) -> Iterator[str]:
    from fv_kernel.serving import ServerThread, create_app

    deploy = DeployConfig(output_dir=tmp_path / "out")
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(wan_toy_causal_card()))
    server = ServerThread(create_app(engine, deploy)).start()
    yield f"ws://{server.host}:{server.port}/v1/realtime/video"
    server.stop()


def _stream(url: str, **extra: Any) -> list[Any]:
    messages: list[Any] = []
    with websockets_sync.connect(url) as ws:
        ws.send(json.dumps({"type": "session.start", "model": "wan-toy-causal", "prompt": PROMPT, "width": 64,
                            "height": 64, "seed": 3, "extra_params": {"max_chunks": 2, **extra}}))
        while True:
            message = ws.recv(timeout=60)
            message = json.loads(message) if isinstance(message, str) else message
            messages.append(message)
            if isinstance(message, dict) and message["type"] == "session.done":
                return messages


def test_websocket_sends_previews_only_to_a_client_that_asked(ws_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image

    from fv_kernel.serving import realtime
    from fv_kernel.testing import recording_loop_use

    encode, on_the_loop = recording_loop_use(realtime.preview_png)  # the PNG is made on a worker thread
    monkeypatch.setattr(realtime, "preview_png", encode)
    plain = _stream(ws_url)
    assert not any(isinstance(m, dict) and m["type"] == "video.preview" for m in plain)
    asked = _stream(ws_url, previews=True)
    kinds = [m["type"] for m in asked if isinstance(m, dict) and m["type"] in ("video.preview", "video.chunk_metadata")]
    assert kinds == ["video.preview", "video.chunk_metadata"] * 2
    previews = [m for m in asked if isinstance(m, dict) and m["type"] == "video.preview"]
    metas = [m for m in asked if isinstance(m, dict) and m["type"] == "video.chunk_metadata"]
    for preview, meta in zip(previews, metas):
        assert preview["generation_chunk_index"] == meta["generation_chunk_index"]
        assert preview["frame_start"] == meta["frame_start"] and preview["mime"] == "image/png"
        image = Image.open(io.BytesIO(base64.b64decode(preview["image"])))
        assert image.format == "PNG" and image.size == (64, 64)
    assert on_the_loop == [False, False]
    # The binary frames (fMP4) are the same count either way: previews add JSON messages only.
    assert sum(isinstance(m, bytes) for m in asked) == sum(isinstance(m, bytes) for m in plain) == 2


def test_the_sse_fallback_relays_previews_to_a_client_that_asked(ws_url: str) -> None:
    """The SSE fallback carries the WebSocket's messages: ``video.preview`` before each ``video.chunk`` when the
    session's ``extra_params.previews`` asks, none otherwise."""
    import httpx

    from fv_kernel.testing import read_sse

    base = ws_url.replace("ws://", "http://").removesuffix("/v1/realtime/video")

    def events(**extra: Any) -> list[tuple[str, dict[str, Any]]]:
        with httpx.Client(base_url=base, timeout=60) as http:
            created = http.post("/v1/realtime/video/sessions", json={
                "model": "wan-toy-causal", "prompt": PROMPT, "width": 64, "height": 64, "seed": 3,
                "extra_params": {"max_chunks": 2, **extra}})
            assert created.status_code == 201, created.text
            seen: list[tuple[str, dict[str, Any]]] = []
            with http.stream("GET", created.json()["events_url"]) as response:
                for event in read_sse(response):
                    seen.append((event["event"], event["data"]))
                    if event["event"] == "session.done":
                        return seen
        raise AssertionError("the stream ended without session.done")

    plain = [kind for kind, _ in events() if kind in ("video.preview", "video.chunk")]
    assert plain == ["video.chunk"] * 2
    asked = events(previews=True)
    assert [kind for kind, _ in asked if kind in ("video.preview", "video.chunk")] == ["video.preview", "video.chunk"] * 2
    previews = [data for kind, data in asked if kind == "video.preview"]
    chunks = [data for kind, data in asked if kind == "video.chunk"]
    for preview, chunk in zip(previews, chunks):
        assert preview["generation_chunk_index"] == chunk["generation_chunk_index"]
        assert base64.b64decode(preview["image"]).startswith(b"\x89PNG")
