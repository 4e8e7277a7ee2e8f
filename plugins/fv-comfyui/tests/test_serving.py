"""ComfyUI's HTTP surface on a real ``fv serve`` (its own process, the plugin found by its entry
point), driven by a third-party ComfyUI client from PyPI (comfy-api-simplified) and by raw
HTTP / websocket calls for what that client does not cover."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")
websockets_sync = pytest.importorskip("websockets.sync.client")
comfy_api = pytest.importorskip("comfy_api_simplified")

from conftest import MODELS_FILE, load_pair, retarget, write_image  # noqa: E402
from fv_kernel.testing import free_port  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("comfy_serve")
    port = free_port()
    # The mapping file the documented way: the deploy config's plugins.settings (no environment variable).
    deploy = work / "deploy.yaml"
    # Previews off: comfy-api-simplified takes every binary websocket message for a result image (as it
    # would from ComfyUI with previews on); the previews themselves are tested in test_serving_ws.py.
    deploy.write_text(f"plugins:\n  settings:\n    fv-comfyui: {{models: {json.dumps(str(MODELS_FILE))}, previews: false}}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FV_PLUGINS", None)
    env.pop("FV_COMFY_MODELS", None)
    script = "import sys; from fv_kernel.cli.app import main; sys.argv = ['fv', *sys.argv[1:]]; main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "serve", "--config", str(deploy), "--model", "wan-tiny", "--model", "wan-tiny-i2v", "--model", "wan-tiny-a14b",
         "--port", str(port), "--log-level", "warning"],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"fv serve did not start: {proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.3)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _t2v() -> dict[str, Any]:
    return retarget(load_pair("text_to_video_wan")[1], steps=3)


def test_a_third_party_client_runs_a_prompt_and_fetches_its_file(server: str) -> None:
    from PIL import Image

    client = comfy_api.ComfyApiWrapper(server)
    files = client.queue_and_wait_images(_t2v(), "SaveAnimatedWEBP")  # queue, /ws, /history, /view
    ((name, data),) = files.items()
    assert name.startswith("ComfyUI_") and name.endswith("_.webp")
    with Image.open(io.BytesIO(data)) as webp:
        assert webp.n_frames == 5 and webp.size == (32, 32)
    assert client.get_object_info("KSampler")["KSampler"]["input"]["required"]["sampler_name"][0] == ["euler", "uni_pc", "uni_pc_bh2"]


def test_an_unmapped_model_name_is_value_not_in_list(server: str) -> None:
    client = comfy_api.ComfyApiWrapper(server)
    prompt = _t2v()
    prompt["37"]["inputs"]["unet_name"] = "some_other_model.safetensors"
    with pytest.raises(comfy_api.exceptions.ComfyApiError, match="400"):
        client.queue_prompt(prompt)
    answer = requests.post(f"{server}/prompt", json={"prompt": prompt}, timeout=30)
    assert answer.status_code == 400
    body = answer.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["37"]["errors"][0]["type"] == "value_not_in_list"
    assert requests.post(f"{server}/prompt", json={"no": "prompt"}, timeout=30).json()["error"]["type"] == "no_prompt"


def test_ws_progress_messages(server: str) -> None:
    client_id = "fv-test-client"
    with websockets_sync.connect(f"{server.replace('http', 'ws')}/ws?clientId={client_id}") as socket_:
        first = json.loads(socket_.recv(timeout=30))
        assert first["type"] == "status" and first["data"]["sid"] == client_id
        posted = requests.post(f"{server}/prompt", json={"prompt": _t2v(), "client_id": client_id}, timeout=60).json()
        assert set(posted) == {"prompt_id", "number", "node_errors"} and posted["node_errors"] == {}
        messages: list[dict[str, Any]] = []
        while True:
            message = json.loads(socket_.recv(timeout=120))
            messages.append(message)
            if message["type"] == "executing" and message["data"]["node"] is None:
                break
    mine = [m for m in messages if m["data"].get("prompt_id") == posted["prompt_id"]]
    kinds = [m["type"] for m in mine]
    assert kinds[:2] == ["execution_start", "execution_cached"]
    executing = [m["data"]["node"] for m in mine if m["type"] == "executing"]
    assert executing.index("3") < executing.index("8") < executing.index("28")
    progress = [(m["data"]["value"], m["data"]["max"], m["data"]["node"]) for m in mine if m["type"] == "progress"]
    assert progress and progress[-1] == (3, 3, "3")
    (executed,) = [m["data"] for m in mine if m["type"] == "executed"]
    assert executed["node"] == "28" and executed["output"]["images"][0]["type"] == "output"
    history = requests.get(f"{server}/history/{posted['prompt_id']}", timeout=30).json()[posted["prompt_id"]]
    assert history["status"]["status_str"] == "success" and history["outputs"]["28"] == executed["output"]
    assert history["prompt"][1] == posted["prompt_id"]
    assert requests.get(f"{server}/history/unknown", timeout=30).json() == {}


def test_upload_then_image_to_video(server: str, tmp_path: Path) -> None:
    client = comfy_api.ComfyApiWrapper(server)
    uploaded = client.upload_image(write_image(tmp_path / "start.png", 40, 40), subfolder="mine")
    assert uploaded == {"name": "start.png", "subfolder": "mine", "type": "input"}
    again = client.upload_image(tmp_path / "start.png", subfolder="mine")  # not overwritten: renamed, as ComfyUI does
    assert again == {"name": "start (1).png", "subfolder": "mine", "type": "input"}
    prompt = retarget(load_pair("image_to_video_wan_example")[1], steps=2)
    prompt["52"]["inputs"]["image"] = "mine/start.png"
    files = client.queue_and_wait_images(prompt, "SaveAnimatedWEBP")
    assert len(files) == 1
    # a LoadImage name outside the input folder is refused like a missing file
    prompt["52"]["inputs"]["image"] = "../output/x.png"
    body = requests.post(f"{server}/prompt", json={"prompt": prompt}, timeout=30).json()
    assert body["node_errors"]["52"]["errors"][0]["type"] == "custom_validation_failed"


def test_view_stays_inside_its_folders(server: str) -> None:
    assert requests.get(f"{server}/view", params={"filename": "jobs.sqlite3", "subfolder": "../.."}, timeout=30).status_code == 404
    assert requests.get(f"{server}/view", params={"filename": "x.webp", "type": "temp"}, timeout=30).status_code == 404


def test_the_served_a14b_card_runs_the_chains_switch_step(server: str) -> None:
    prompt = retarget(load_pair("text_to_video_wan22_14B")[1])  # switch at step 2, not the card's boundary's
    prompt["57"]["inputs"]["sampler_name"] = prompt["58"]["inputs"]["sampler_name"] = "uni_pc"
    files = comfy_api.ComfyApiWrapper(server).queue_and_wait_images(prompt, "SaveAnimatedWEBP")
    assert len(files) == 1


def test_queue_and_object_info_shapes(server: str) -> None:
    assert set(requests.get(f"{server}/queue", timeout=30).json()) == {"queue_running", "queue_pending"}
    assert requests.get(f"{server}/prompt", timeout=30).json() == {"exec_info": {"queue_remaining": 0}}
    info = requests.get(f"{server}/object_info", timeout=30).json()
    assert "WanImageToVideo" in info and info["UNETLoader"]["input"]["required"]["unet_name"][0][0].endswith(".safetensors")
    assert info["SaveAnimatedWEBP"]["output_node"] is True
    assert "system" in comfy_api.ComfyApiWrapper(server).get_system_stats()


def test_the_custom_node_can_call_a_running_fv_serve(server: str) -> None:
    from fv_comfyui.comfy_nodes import FvGenerate

    node = FvGenerate()
    defaults = {name: entry[1]["default"] for name, entry in FvGenerate.INPUT_TYPES()["required"].items()}
    (frames,) = node.generate(**{**defaults, "prompt": "a red fox", "seed": 3, "width": 32, "height": 32, "frames": 5,
                                 "steps": 2}, server_url=server)
    assert frames.shape == (5, 32, 32, 3)
    from fv_kernel.api import load

    exact = load("wan-tiny").generate("a red fox", seed=3, width=32, height=32, frames=5, steps=2).frames.permute(0, 2, 3, 1)
    assert (frames - exact).abs().mean() < 0.05  # the server's MP4 is H.264: close, not equal


def test_queue_numbers_are_comfyuis(server: str) -> None:
    first = requests.post(f"{server}/prompt", json={"prompt": _t2v()}, timeout=60).json()["number"]
    second = requests.post(f"{server}/prompt", json={"prompt": _t2v()}, timeout=60).json()["number"]
    front = requests.post(f"{server}/prompt", json={"prompt": _t2v(), "front": True}, timeout=60).json()["number"]
    assert second == first + 1 and front == -(second + 1)
