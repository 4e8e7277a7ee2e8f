"""PSNR and SSIM: known values, and SSIM against a direct per-window computation."""

from __future__ import annotations

import math

import pytest
import torch

from fv_cachedit.quality import psnr, ssim


def direct_ssim(a: torch.Tensor, b: torch.Tensor, size: int = 11, sigma: float = 1.5) -> float:
    """One channel, one frame, window by window (no convolutions), as the paper writes it."""
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    w = torch.outer(g, g) / torch.outer(g, g).sum()
    c1, c2 = 0.01**2, 0.03**2
    values = []
    for i in range(a.shape[0] - size + 1):
        for j in range(a.shape[1] - size + 1):
            x, y = a[i : i + size, j : j + size].double(), b[i : i + size, j : j + size].double()
            mx, my = (w * x).sum(), (w * y).sum()
            vx, vy = (w * (x - mx) ** 2).sum(), (w * (y - my) ** 2).sum()
            cxy = (w * (x - mx) * (y - my)).sum()
            values.append(((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))
    return torch.stack(values).mean().item()


def test_ssim_matches_the_per_window_definition() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.rand(16, 14, generator=g)
    b = (a + 0.1 * torch.randn(16, 14, generator=g)).clamp(0, 1)
    assert ssim(a.view(1, 1, 16, 14), b.view(1, 1, 16, 14)) == pytest.approx(direct_ssim(a, b), abs=1e-10)


def test_ssim_and_psnr_known_values() -> None:
    g = torch.Generator().manual_seed(1)
    video = torch.rand(3, 3, 20, 24, generator=g)
    assert ssim(video, video) == pytest.approx(1.0) and psnr(video, video) == math.inf
    slightly = (video + 0.01 * torch.randn(video.shape, generator=g)).clamp(0, 1)
    very = (video + 0.2 * torch.randn(video.shape, generator=g)).clamp(0, 1)
    assert 1.0 > ssim(video, slightly) > ssim(video, very) > 0.0
    assert ssim(video, very) == pytest.approx(ssim(very, video))
    assert psnr(video, torch.clamp(video + 0.1, max=10.0)) == pytest.approx(20.0)  # MSE 0.01
    with pytest.raises(ValueError, match="shapes differ"):
        ssim(video, video[:2])
