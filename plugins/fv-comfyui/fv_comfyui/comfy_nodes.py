"""A ComfyUI custom-node pack: "fv Generate" runs an fv card from inside a ComfyUI graph.

ComfyUI loads a custom node package from ``custom_nodes/<name>/__init__.py`` and reads its
``NODE_CLASS_MAPPINGS`` (and ``NODE_DISPLAY_NAME_MAPPINGS``). With fv-comfyui installed in
ComfyUI's Python, the whole package is one line::

    # ComfyUI/custom_nodes/fv/__init__.py
    from fv_comfyui.comfy_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

The node takes a prompt and fv's generation settings and returns ComfyUI ``IMAGE`` frames
(a float tensor ``(frames, height, width, 3)`` in [0, 1]) for any image node downstream
(``SaveAnimatedWEBP``, ``CreateVideo``...). It runs the card in-process (``fv.load``, the
generator kept on the node object, which ComfyUI reuses across runs), or, with ``server_url``
set, asks a running ``fv serve`` (``POST /v1/videos``, then the MP4, decoded: H.264 is lossy,
so those frames are close to, not equal to, the server's).
"""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import torch

__all__ = ["FvGenerate", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "FvNodeError"]


class FvNodeError(RuntimeError):
    """The node could not generate; ComfyUI shows the message on the node."""


def _image_to_chw(image: torch.Tensor) -> torch.Tensor:
    """ComfyUI ``IMAGE`` (B, H, W, C) → fv's (3, H, W), the first image of the batch."""
    if image.ndim != 4 or image.shape[-1] < 3:
        raise FvNodeError(f"image: expected a ComfyUI IMAGE (batch, height, width, channels), got {tuple(image.shape)}")
    return image[0, :, :, :3].permute(2, 0, 1).float().clamp(0, 1).contiguous()


class FvGenerate:
    """Generate a video with an fv card; returns its frames as a ComfyUI IMAGE batch."""

    CATEGORY = "fv"
    FUNCTION = "generate"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("frames",)
    DESCRIPTION = "Generate a video with an fv card (in-process, or on a running fv serve)."

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802 - ComfyUI's name
        return {
            "required": {
                "prompt": ("STRING", {"multiline": True, "default": ""}),
                "model": ("STRING", {"default": "wan-tiny", "tooltip": "an fv card id (fv cards list)"}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 2**63 - 1, "control_after_generate": True}),
                "width": ("INT", {"default": 0, "min": 0, "max": 16384, "step": 16, "tooltip": "0: the card's default"}),
                "height": ("INT", {"default": 0, "min": 0, "max": 16384, "step": 16, "tooltip": "0: the card's default"}),
                "frames": ("INT", {"default": 0, "min": 0, "max": 4096, "tooltip": "0: the card's default"}),
                "steps": ("INT", {"default": 0, "min": 0, "max": 1000, "tooltip": "0: the card's default"}),
                "guidance": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 100.0, "step": 0.1,
                                       "tooltip": "negative: the card's default"}),
            },
            "optional": {
                "negative_prompt": ("STRING", {"multiline": True, "default": ""}),
                "image": ("IMAGE", {"tooltip": "the first frame: image-to-video"}),
                "server_url": ("STRING", {"default": "", "tooltip": "a running fv serve; empty: run in this process"}),
            },
        }

    def __init__(self) -> None:
        self._generators: dict[str, Any] = {}

    @staticmethod
    def options(seed: int, width: int, height: int, frames: int, steps: int, guidance: float,
                negative_prompt: str) -> dict[str, Any]:
        """The fv generate options the widgets ask for (0 / negative: the card's default)."""
        options: dict[str, Any] = {"seed": int(seed)}
        for name, value in (("width", width), ("height", height), ("frames", frames), ("steps", steps)):
            if int(value) > 0:
                options[name] = int(value)
        if float(guidance) >= 0:
            options["guidance"] = float(guidance)
        if negative_prompt:
            options["negative_prompt"] = negative_prompt
        return options

    def generate(self, prompt: str, model: str, seed: int, width: int, height: int, frames: int, steps: int,
                 guidance: float, negative_prompt: str = "", image: torch.Tensor | None = None,
                 server_url: str = "") -> tuple[torch.Tensor]:
        options = self.options(seed, width, height, frames, steps, guidance, negative_prompt)
        start = _image_to_chw(image) if image is not None else None
        if server_url:
            video = _generate_on_server(server_url, model, prompt, options, start)
        else:
            video = self._generate_here(model, prompt, options, start)
        return (video.permute(0, 2, 3, 1).contiguous(),)

    def _generate_here(self, model: str, prompt: str, options: dict[str, Any], image: torch.Tensor | None) -> torch.Tensor:
        from fv_kernel.api import FvError, load

        try:
            if model not in self._generators:
                self._generators[model] = load(model)
            if image is not None:
                options = {**options, "image": image}
            return self._generators[model].generate(prompt, **options).frames
        except FvError as exc:
            raise FvNodeError(exc.message) from None


def _request(url: str, data: bytes | None = None) -> bytes:
    headers = {"Content-Type": "application/json"} if data is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as answer:
            return bytes(answer.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise FvNodeError(f"fv serve answered {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise FvNodeError(f"cannot reach fv serve at {url}: {exc.reason}") from None


def _generate_on_server(server: str, model: str, prompt: str, options: dict[str, Any],
                        image: torch.Tensor | None, *, timeout_s: float = 3600.0) -> torch.Tensor:
    """``POST /v1/videos`` on a running ``fv serve``, wait for it, and decode its MP4."""
    import av

    body: dict[str, Any] = {"model": model, "prompt": prompt, "seed": options["seed"]}
    for name in ("frames", "steps", "guidance", "negative_prompt"):
        if name in options:
            body[name] = options[name]
    if "width" in options or "height" in options:
        if not ("width" in options and "height" in options):
            raise FvNodeError("width and height: a server request sets both or neither")
        body["size"] = f"{options['width']}x{options['height']}"
    if image is not None:
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray((image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(buffer, format="PNG")
        body["input_reference"] = base64.b64encode(buffer.getvalue()).decode("ascii")
    base = server.rstrip("/")
    job = json.loads(_request(f"{base}/v1/videos", json.dumps(body).encode()))
    deadline = time.monotonic() + timeout_s
    while job["status"] not in ("completed", "failed", "cancelled"):
        if time.monotonic() > deadline:
            raise FvNodeError(f"fv serve job {job['id']} did not finish in {timeout_s:g} s")
        time.sleep(0.2)
        job = json.loads(_request(f"{base}/v1/videos/{job['id']}"))
    if job["status"] != "completed":
        error = job.get("error") or {}
        raise FvNodeError(f"fv serve job {job['id']} {job['status']}: {error.get('message', '')}")
    data = _request(f"{base}/v1/videos/{job['id']}/content")
    with av.open(io.BytesIO(data)) as container:
        frames = [torch.from_numpy(frame.to_ndarray(format="rgb24")) for frame in container.decode(video=0)]
    return torch.stack(frames).permute(0, 3, 1, 2).float() / 255.0


NODE_CLASS_MAPPINGS = {"FvGenerate": FvGenerate}
NODE_DISPLAY_NAME_MAPPINGS = {"FvGenerate": "fv Generate"}
