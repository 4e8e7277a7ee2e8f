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
    pipe = fv.load("wan-toy-causal")
    versions = []
    update = None
    with pipe.session(PROMPT, seed=3, previews=True, max_chunks=CHUNKS) as session:
        for chunk in session:
            versions.append((chunk.index, chunk.preview, chunk.prompt_version))
            if chunk.index == 0 and chunk.preview:
                update = session.update(PROMPT.replace("left", "right"))
    # The update may land while chunk 0 is at its preview: then chunk 0 restarts under it (version 1);
    # either way every chunk after the first is generated under it, with its own preview first.
    assert update is not None and versions[0][2] != update
    assert versions[-2:] == [(CHUNKS - 1, True, update), (CHUNKS - 1, False, update)]
    assert [index for index, preview, _ in versions if not preview] == list(range(CHUNKS))


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


def test_websocket_sends_previews_only_to_a_client_that_asked(ws_url: str) -> None:
    from PIL import Image

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
    # The binary frames (fMP4) are the same count either way: previews add JSON messages only.
    assert sum(isinstance(m, bytes) for m in asked) == sum(isinstance(m, bytes) for m in plain) == 2
