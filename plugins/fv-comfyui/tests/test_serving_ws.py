"""``/ws`` as ComfyUI sends it (``status``, ``execution_start``, ``executing``, ``progress``, binary
preview frames) and ``POST /interrupt``, on fv's app with the plugin's routes, through FastAPI's
TestClient websocket."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from conftest import MODELS_FILE, load_api, load_pair, retarget  # noqa: E402
from fv_comfyui.previews import LatentPreviewer, preview_frame  # noqa: E402


def _client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, previews: bool | None = None) -> TestClient:
    from fv_kernel.api import DeployConfig, build_engine
    from fv_kernel.serving.app import create_app

    monkeypatch.delenv("FV_COMFY_MODELS", raising=False)
    monkeypatch.delenv("FV_PLUGINS", raising=False)
    settings: dict[str, Any] = {"models": str(MODELS_FILE)}
    if previews is not None:
        settings["previews"] = previews
    config = DeployConfig.model_validate({
        "cards": [{"model": "wan-tiny"}, {"model": "wan-tiny-ti2v"}], "output_dir": str(tmp_path),
        "plugins": {"settings": {"fv-comfyui": settings}},
    })
    app = create_app(build_engine(config), config)
    assert hasattr(app.state, "comfyui"), "the ComfyUI routes were not mounted"
    return TestClient(app)


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    with _client(tmp_path, monkeypatch) as test_client:
        yield test_client


def _t2v(steps: int = 3) -> dict[str, Any]:
    return retarget(load_pair("text_to_video_wan")[1], steps=steps)


def _until_done(socket: Any, prompt_id: str) -> list[Any]:
    """Every message (dicts for JSON, bytes for binary) up to this prompt's ``executing`` null."""
    received: list[Any] = []
    while True:
        message = socket.receive()
        if message.get("bytes") is not None:
            received.append(message["bytes"])
            continue
        data = json.loads(message["text"])
        received.append(data)
        if data["type"] == "executing" and data["data"]["node"] is None and data["data"].get("prompt_id") == prompt_id:
            return received


def _json(messages: list[Any], prompt_id: str) -> list[dict[str, Any]]:
    return [m for m in messages if isinstance(m, dict) and m["data"].get("prompt_id") == prompt_id]


def test_ws_messages_are_comfyuis_with_a_preview_per_step(client: TestClient) -> None:
    with client.websocket_connect("/ws?clientId=me") as socket:
        status = json.loads(socket.receive_text())
        assert status == {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}, "sid": "me"}}
        posted = client.post("/prompt", json={"prompt": _t2v(3), "client_id": "me"}).json()
        messages = _until_done(socket, posted["prompt_id"])
    mine = _json(messages, posted["prompt_id"])
    assert mine[0]["type"] == "execution_start"
    assert any(m["type"] == "status" and m["data"]["status"]["exec_info"]["queue_remaining"] == 1 for m in messages
               if isinstance(m, dict))
    executing = [m["data"]["node"] for m in mine if m["type"] == "executing"]
    assert executing.index("3") < executing.index("8") < executing.index("28") and executing[-1] is None
    progress = [m["data"] for m in mine if m["type"] == "progress"]
    assert progress == [{"value": v, "max": 3, "node": "3", "prompt_id": posted["prompt_id"]} for v in (1, 2, 3)]
    # One binary preview right after each progress message: ComfyUI's framing, a JPEG.
    kinds = ["progress" if isinstance(m, dict) and m["type"] == "progress" else "bytes" if isinstance(m, bytes) else None
             for m in messages]
    assert [k for k in kinds if k] == ["progress", "bytes"] * 3
    for frame in (m for m in messages if isinstance(m, bytes)):
        event, image_type = struct.unpack(">II", frame[:8])
        assert (event, image_type) == (1, 1) and frame[8:10] == b"\xff\xd8"
        from PIL import Image

        with Image.open(io.BytesIO(frame[8:])) as preview:
            assert preview.format == "JPEG" and max(preview.size) <= 32  # latent resolution, not the video's
    assert [m["type"] for m in mine][-2:] == ["execution_success", "executing"]


def test_previews_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _client(tmp_path, monkeypatch, previews=False) as test_client:
        with test_client.websocket_connect("/ws?clientId=me") as socket:
            socket.receive_text()
            posted = test_client.post("/prompt", json={"prompt": _t2v(2), "client_id": "me"}).json()
            messages = _until_done(socket, posted["prompt_id"])
    assert not any(isinstance(m, bytes) for m in messages)
    assert [m["data"]["value"] for m in _json(messages, posted["prompt_id"]) if m["type"] == "progress"] == [1, 2]


def test_the_ti2v_template_runs_and_reports_its_nodes(client: TestClient) -> None:
    prompt = retarget(load_api("wan22_ti2v_5B_t2v"), steps=2)
    with client.websocket_connect("/ws?clientId=me") as socket:
        socket.receive_text()
        posted = client.post("/prompt", json={"prompt": prompt, "client_id": "me"}).json()
        assert posted["node_errors"] == {}, posted
        messages = _until_done(socket, posted["prompt_id"])
    mine = _json(messages, posted["prompt_id"])
    executing = [m["data"]["node"] for m in mine if m["type"] == "executing"]
    assert executing.index("55") < executing.index("3") < executing.index("8") < executing.index("58")
    (executed,) = [m["data"] for m in mine if m["type"] == "executed"]
    assert executed["node"] == "58" and executed["output"]["images"][0]["filename"].endswith(".mp4")


def test_interrupt_stops_the_running_prompt_and_the_queue_goes_on(client: TestClient) -> None:
    with client.websocket_connect("/ws?clientId=me") as socket:
        socket.receive_text()
        first = client.post("/prompt", json={"prompt": _t2v(400), "client_id": "me"}).json()["prompt_id"]
        second = client.post("/prompt", json={"prompt": _t2v(2), "client_id": "me"}).json()["prompt_id"]
        messages: list[Any] = []
        while True:  # wait until the first prompt's sampler is running
            message = socket.receive()
            if message.get("text") is None:
                continue
            data = json.loads(message["text"])
            messages.append(data)
            if data["type"] == "progress":
                break
        # An interrupt naming another prompt leaves the running one alone (negative control).
        assert client.post("/interrupt", json={"prompt_id": second}).status_code == 200
        assert client.get("/queue").json()["queue_running"][0][1] == first
        assert client.post("/interrupt").status_code == 200
        messages += _until_done(socket, first)
        messages += _until_done(socket, second)
    (interrupted,) = [m for m in messages if isinstance(m, dict) and m["type"] == "execution_interrupted"]
    assert interrupted["data"]["prompt_id"] == first and interrupted["data"]["node_id"] == "3"
    assert interrupted["data"]["node_type"] == "KSampler" and interrupted["data"]["executed"] == []
    steps = [m["data"]["value"] for m in _json(messages, first) if m["type"] == "progress"]
    assert steps and steps[-1] < 400  # stopped early
    assert not any(m["type"] == "executed" for m in _json(messages, first))
    history = client.get(f"/history/{first}").json()[first]
    assert history["status"]["status_str"] == "error" and history["status"]["completed"] is False
    assert [kind for kind, _ in history["status"]["messages"]][-1] == "execution_interrupted"
    assert client.get(f"/history/{second}").json()[second]["status"]["status_str"] == "success"
    # Nothing running: an interrupt is a no-op, as in ComfyUI.
    assert client.post("/interrupt").status_code == 200


def _flow_path(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    return (1.0 - sigma) * x0 + sigma * noise


def _groups(latent: torch.Tensor) -> torch.Tensor:
    # Written out apart from the code: the first frame's channels averaged in three interleaved groups.
    frame = latent[0, :, 0]
    return torch.stack([frame[0::3].mean(0), frame[1::3].mean(0), frame[2::3].mean(0)])


@pytest.mark.parametrize("sampler", ["euler", "uni_pc", "uni_pc_bh2"])
def test_the_preview_schedule_is_the_one_the_sampler_runs(sampler: str) -> None:
    """The previewer's sigmas are the running sampler's: for uni_pc, KSampler's schedule for one step
    more with the next-to-last sigma dropped (written out here), not the plain scheduler's."""
    from types import SimpleNamespace

    from fv_comfyui.samplers import comfy_sigmas
    from fv_comfyui.serving import _schedule

    job = SimpleNamespace(options={"sampler": f"comfy-{sampler}-simple", "shift": 8.0, "steps": 6})
    plain = comfy_sigmas("simple", 8.0, 6)
    longer = comfy_sigmas("simple", 8.0, 7)
    expected = plain if sampler == "euler" else torch.cat([longer[:6], longer[7:]])
    assert torch.equal(_schedule(job), expected)
    assert _schedule(SimpleNamespace(options={"sampler": "unipc", "shift": 8.0, "steps": 6})) is None  # not a comfy sampler


def test_the_preview_is_the_denoised_estimate_along_the_last_move() -> None:
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 16, 3, 6, 10, generator=generator)
    noise = torch.randn(1, 16, 3, 6, 10, generator=generator)
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.0])
    previewer = LatentPreviewer(sigmas)
    first = previewer.estimate(_flow_path(x0, noise, 0.8), 1)
    assert torch.allclose(first, _groups(_flow_path(x0, noise, 0.8)))  # no move yet: the latent itself
    second = previewer.estimate(_flow_path(x0, noise, 0.5), 2)
    assert torch.allclose(second, _groups(x0), atol=1e-5)  # a straight (Euler) path: exactly the clean latent
    assert not torch.allclose(_groups(_flow_path(x0, noise, 0.5)), _groups(x0), atol=1e-2)  # the latent alone is not
    assert previewer(_flow_path(x0, noise, 0.0), 3)[:2] == b"\xff\xd8"
    assert preview_frame(b"JPEG") == b"\x00\x00\x00\x01\x00\x00\x00\x01JPEG"


def test_a_preview_is_at_most_512_pixels() -> None:
    from PIL import Image

    big = torch.randn(1, 16, 1, 96, 1200)  # a latent wider than ComfyUI's default --preview-size
    with Image.open(io.BytesIO(LatentPreviewer(None)(big, 1))) as preview:
        assert preview.size == (512, 41)
    with Image.open(io.BytesIO(LatentPreviewer(None)(torch.randn(1, 16, 1, 6, 10), 1))) as preview:
        assert preview.size == (10, 6)  # latent resolution, never upscaled


def test_binary_frames_go_to_the_prompts_client_or_to_everyone(tmp_path: Path) -> None:
    import asyncio

    from fv_kernel.api import DeployConfig, Engine
    from fv_comfyui.models import ModelMap
    from fv_comfyui.serving import ComfyServer

    class Socket:
        def __init__(self) -> None:
            self.got: list[bytes] = []

        async def send_bytes(self, data: bytes) -> None:
            self.got.append(data)

    server = ComfyServer(Engine(), DeployConfig(output_dir=tmp_path), ModelMap({}))
    mine, other = Socket(), Socket()
    server.clients.update(mine=mine, other=other)
    asyncio.run(server.send_bytes(b"a", "mine"))
    asyncio.run(server.send_bytes(b"b", None))
    assert mine.got == [b"a", b"b"] and other.got == [b"b"]


def test_a_failing_preview_never_fails_the_prompt(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Any, latents: torch.Tensor, step: int) -> bytes:
        raise RuntimeError("no JPEG today")

    monkeypatch.setattr(LatentPreviewer, "__call__", broken)
    with client.websocket_connect("/ws?clientId=me") as socket:
        socket.receive_text()
        posted = client.post("/prompt", json={"prompt": _t2v(2), "client_id": "me"}).json()
        messages = _until_done(socket, posted["prompt_id"])
    assert not any(isinstance(m, bytes) for m in messages)
    assert "execution_success" in [m["type"] for m in _json(messages, posted["prompt_id"])]
