"""Tiny Wan VAE configs shared by the VAE tests (parity against diffusers, fused decode).

Small but structurally complete: channel growth (1x1x1 shortcuts, 2.1 channel halving in
upsamplers), two temporal and three spatial resamplings, mid attention.
"""

from __future__ import annotations

from fv_wan.models.vae import WanVAEConfig

__all__ = ["CFG21", "CFG22"]

CFG21 = WanVAEConfig(
    base_dim=4, z_dim=4, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
    latents_mean=(0.1, -0.2, 0.3, -0.4), latents_std=(1.5, 0.5, 2.0, 0.8),
)  # fmt: skip
CFG22 = WanVAEConfig(
    base_dim=4, decoder_base_dim=6, z_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1, is_residual=True,
    in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
    latents_mean=tuple(0.1 * i for i in range(8)), latents_std=tuple(0.5 + 0.1 * i for i in range(8)),
)  # fmt: skip
