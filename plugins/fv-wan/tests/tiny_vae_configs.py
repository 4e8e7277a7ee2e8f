"""Tiny Wan VAE configs shared by the VAE tests (parity against diffusers, fused decode).

Small but structurally complete: channel growth (1x1x1 shortcuts, 2.1 channel halving in
upsamplers), two temporal and three spatial resamplings, mid attention.
"""

from __future__ import annotations

import torch

from fv_wan.models.vae import WanVAE, WanVAEConfig

__all__ = ["CFG21", "CFG22", "seeded_vae"]

CFG21 = WanVAEConfig(
    base_dim=4, z_dim=4, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
    latents_mean=(0.1, -0.2, 0.3, -0.4), latents_std=(1.5, 0.5, 2.0, 0.8),
)  # fmt: skip
CFG22 = WanVAEConfig(
    base_dim=4, decoder_base_dim=6, z_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1, is_residual=True,
    in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
    latents_mean=tuple(0.1 * i for i in range(8)), latents_std=tuple(0.5 + 0.1 * i for i in range(8)),
)  # fmt: skip


def seeded_vae(cfg: WanVAEConfig, dtype: torch.dtype = torch.float32, device: str = "cpu") -> WanVAE:
    """A VAE of ``cfg`` with seeded weights and non-trivial gammas and biases (their defaults are ones / zeros)."""
    torch.manual_seed(0)
    vae = WanVAE(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("gamma") else 0.1 * noise if name.endswith("bias") else p)
    return vae.to(device, dtype)
