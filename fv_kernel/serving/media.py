"""Image decoding for I2V inputs, preview frames for SSE, and the files a finished job writes."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path

import torch
import torch.nn.functional as F

from fv_kernel.io.media import encode_png, write_mp4
from fv_kernel.request.artifacts import VideoArtifact
from fv_kernel.serving.errors import ApiError

__all__ = ["decode_base64", "probe_image", "decode_pixels", "decode_image", "preview_png", "write_job_files", "VARIANTS"]

#: Content a job can have: variant -> (file name inside the job's folder, media type).
#: File names are constants; the folder is the server-generated job id.
VARIANTS: dict[str, tuple[str, str]] = {
    "video": ("video.mp4", "video/mp4"),
    "thumbnail": ("thumbnail.png", "image/png"),
}

_PREVIEW_MAX_SIDE = 256


def decode_base64(text: str, *, param: str) -> bytes:
    """The bytes of a base64 image (optionally a ``data:image/...;base64,`` URL)."""
    payload = text.strip()
    if payload.startswith("data:"):
        header, sep, payload = payload.partition(",")
        if not sep or ";base64" not in header:
            raise ApiError(400, "invalid_image", f"{param}: a data URL must be base64-encoded", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "invalid_image", f"{param}: not valid base64", param=param) from None


def probe_image(data: bytes, *, param: str, max_pixels: int) -> tuple[int, int]:
    """The (width, height) an encoded image declares in its header; refuses one over ``max_pixels`` (413).

    ``Image.open`` reads only the header, so a small file declaring a huge canvas (a
    decompression bomb) is refused before a single pixel is decoded.
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ApiError(400, "invalid_image", f"{param}: empty image", param=param)
    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ApiError(400, "invalid_image", f"{param}: not a decodable image ({type(exc).__name__})", param=param) from None
    if width * height > max_pixels:
        raise ApiError(
            413, "image_too_large",
            f"{param}: the image declares {width}x{height} = {width * height} pixels; allowed: <= {max_pixels}",
            param=param,
        )
    return width, height


def decode_pixels(data: bytes, *, param: str) -> torch.Tensor:
    """Encoded image bytes (PNG, JPEG, WebP, ...) as a (3, H, W) float tensor in [0, 1]. Slow: call off the event loop."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
            width, height = rgb.size
            pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(height, width, 3)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ApiError(400, "invalid_image", f"{param}: not a decodable image ({type(exc).__name__})", param=param) from None
    return pixels.permute(2, 0, 1).float().div(255.0).contiguous()


def decode_image(data: bytes, *, param: str, max_pixels: int) -> torch.Tensor:
    """:func:`probe_image`, then :func:`decode_pixels`."""
    probe_image(data, param=param, max_pixels=max_pixels)
    return decode_pixels(data, param=param)


def preview_png(frames: torch.Tensor) -> bytes | None:
    """The last frame of a preview chunk as a small PNG, or None if the tensor is not image-shaped."""
    t = frames.detach().float().cpu()
    if t.ndim == 5:  # (B, C, F, H, W)
        t = t[0].transpose(0, 1)
    if t.ndim == 4:  # (F, C, H, W)
        t = t[-1]
    if t.ndim != 3 or t.shape[0] != 3:
        return None
    height, width = int(t.shape[1]), int(t.shape[2])
    scale = _PREVIEW_MAX_SIDE / max(height, width)
    if scale < 1:
        size = (max(1, int(height * scale)), max(1, int(width * scale)))
        t = F.interpolate(t.unsqueeze(0), size=size, mode="area")[0]
    return encode_png(t.clamp(0, 1))


def write_job_files(artifact: VideoArtifact, folder: Path) -> list[str]:
    """Write a finished video (MP4) and its thumbnail (first frame, PNG); returns the variants written."""
    folder.mkdir(parents=True, exist_ok=True)
    video_name, _ = VARIANTS["video"]
    thumb_name, _ = VARIANTS["thumbnail"]
    # Write to a temporary name and rename, so a crash never leaves a half-written file under the real name.
    tmp_video = folder / f".{video_name}.tmp"
    write_mp4(artifact.frames, artifact.fps, tmp_video)
    tmp_video.replace(folder / video_name)
    tmp_thumb = folder / f".{thumb_name}.tmp"
    tmp_thumb.write_bytes(encode_png(artifact.frames[0]))
    tmp_thumb.replace(folder / thumb_name)
    return ["video", "thumbnail"]
