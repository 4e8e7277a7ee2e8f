"""Quality of a cached video against the uncached one: PSNR and SSIM on decoded frames.

SSIM is Wang et al. (2004): an 11-tap Gaussian window (sigma 1.5) over each channel,
``C1 = (0.01 L)^2``, ``C2 = (0.03 L)^2``, valid positions only, averaged over positions,
channels and frames. Frames smaller than the window use the largest odd window that fits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["psnr", "ssim"]


def _as_frames(video: torch.Tensor) -> torch.Tensor:
    """(F, C, H, W) or (C, H, W) -> float64 (F, C, H, W), on its device (a GPU computes 81-frame SSIM in well under a second)."""
    if video.dim() == 3:
        video = video.unsqueeze(0)
    if video.dim() != 4:
        raise ValueError(f"expected frames shaped (F, C, H, W) or (C, H, W), got {tuple(video.shape)}")
    return video.detach().to(dtype=torch.float64)


def psnr(reference: torch.Tensor, test: torch.Tensor, *, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB over the whole video (inf when identical)."""
    a, b = _as_frames(reference), _as_frames(test)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    mse = torch.mean((a - b.to(a.device)) ** 2).item()
    return math.inf if mse == 0.0 else 10.0 * math.log10(data_range**2 / mse)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim(reference: torch.Tensor, test: torch.Tensor, *, data_range: float = 1.0, window: int = 11, sigma: float = 1.5) -> float:
    """Mean structural similarity of two videos with values in ``[0, data_range]``."""
    a, b = _as_frames(reference), _as_frames(test)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    b = b.to(a.device)
    frames, channels, height, width = a.shape
    size = min(window, height, width)
    size -= 1 - size % 2  # odd
    kernel = _gaussian_window(size, sigma).to(a.device).expand(channels, 1, size, size)

    def blur(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, kernel, groups=channels)

    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return index.mean().item()
