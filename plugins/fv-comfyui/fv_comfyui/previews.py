"""Latent previews for ComfyUI clients: one small JPEG per sampler step, framed as ComfyUI frames it.

ComfyUI's server sends a sampler step's preview as a binary websocket message: a 4-byte
big-endian event type (``1``, ``PREVIEW_IMAGE``), a 4-byte big-endian image type (``1`` JPEG,
``2`` PNG), then the image file (``server.py``, ``send_image`` / ``encode_bytes``). Its frontend
draws it on the node that is executing.

What the image shows, and what it costs: decoding a frame with the VAE at every step would
cost a decode per step, so fv does what ComfyUI's ``Latent2RGB`` previewer does in spirit, a
linear projection of the first latent frame at latent resolution (1/8 or 1/16 of the video's),
with no VAE. fv has no fitted latent-to-colour factors for its cards, so the colours are false:
the latent channels are averaged in three interleaved groups (R, G, B), each scaled to its own
spread. Like ComfyUI it previews the denoised estimate, here from the last two latents of the
schedule (``x_k - sigma_k * (x_k - x_{k-1}) / (sigma_k - sigma_{k-1})``, the clean latent along
the last move; exact for Euler, the move's direction for UniPC); the first step shows the
latent itself. The projection is computed on the device on one latent frame, then a (h, w, 3)
byte image goes to the CPU and is JPEG-encoded: per step, far less than a model call.
"""

from __future__ import annotations

import io
import struct

import torch

__all__ = ["PREVIEW_IMAGE", "JPEG", "MAX_PREVIEW_SIZE", "preview_frame", "project_latent", "LatentPreviewer"]

#: ComfyUI's ``BinaryEventTypes.PREVIEW_IMAGE`` and the image type of a JPEG preview.
PREVIEW_IMAGE = 1
JPEG = 1
#: ComfyUI's default ``--preview-size``: the longer side of a preview, at most.
MAX_PREVIEW_SIZE = 512


def preview_frame(image_bytes: bytes, image_type: int = JPEG) -> bytes:
    """The binary websocket message ComfyUI sends for one preview image."""
    return struct.pack(">I", PREVIEW_IMAGE) + struct.pack(">I", image_type) + image_bytes


def project_latent(latents: torch.Tensor) -> torch.Tensor:
    """(C, h, w) float projection of the first latent frame of ``latents`` ((B,) C, T, h, w) to 3 channels."""
    frame = latents.detach()
    while frame.dim() > 4:
        frame = frame[0]  # the first row of the batch
    frame = frame[:, 0] if frame.dim() == 4 else frame  # (C, T, h, w) -> the first latent frame
    frame = frame.float()
    groups = [frame[i::3].mean(dim=0) for i in range(3)] if frame.shape[0] >= 3 else [frame.mean(dim=0)] * 3
    return torch.stack(groups)


def _to_jpeg(rgb: torch.Tensor, max_size: int) -> bytes:
    from PIL import Image

    flat = rgb.reshape(3, -1)
    mean = flat.mean(dim=1).view(3, 1, 1)
    std = flat.std(dim=1).clamp_min(1e-6).view(3, 1, 1) if flat.shape[1] > 1 else torch.ones(3, 1, 1, device=rgb.device)
    scaled = ((rgb - mean) / (4.0 * std) + 0.5).clamp(0.0, 1.0)  # +-2 standard deviations fill the byte range
    array = (scaled * 255.0).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    image = Image.fromarray(array)
    if max(image.size) > max_size:
        image.thumbnail((max_size, max_size))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


class LatentPreviewer:
    """Turns one job's denoise latents, step after step, into preview JPEGs.

    ``sigmas``: the schedule (``steps + 1`` values, the last 0); ``None`` shows each latent itself.
    """

    def __init__(self, sigmas: torch.Tensor | None, max_size: int = MAX_PREVIEW_SIZE) -> None:
        self.sigmas = sigmas
        self.max_size = max_size
        self._previous: tuple[int, torch.Tensor] | None = None

    def estimate(self, latents: torch.Tensor, step: int) -> torch.Tensor:
        """The projected denoised estimate after ``step`` steps (``latents`` at ``sigmas[step]``)."""
        current = project_latent(latents)
        previous, self._previous = self._previous, (step, current)
        sigmas = self.sigmas
        if previous is None or sigmas is None or previous[0] != step - 1 or not 0 < step < len(sigmas):
            return current
        sigma, sigma_before = float(sigmas[step]), float(sigmas[step - 1])
        if sigma_before == sigma:
            return current
        # Linear in the latents, so it is computed on the projections (three channels, not C).
        return current - sigma * (current - previous[1]) / (sigma - sigma_before)

    def __call__(self, latents: torch.Tensor, step: int) -> bytes:
        """The JPEG preview after ``step`` steps."""
        return _to_jpeg(self.estimate(latents, step), self.max_size)
