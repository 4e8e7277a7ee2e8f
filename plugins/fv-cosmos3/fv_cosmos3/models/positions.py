"""3D mRoPE position ids for the joint sequence, mirroring the diffusers Cosmos 3 pipeline.

Text tokens use (i, i, i). Media start at ``text_len + margin`` on the temporal axis;
video uses a (t, h, w) grid (h, w restarting at 0) with an FPS-modulated float t;
sound and action are (t, 0, 0) on the same temporal origin as video.
"""

from __future__ import annotations

import math

import torch

from .config import Cosmos3Config


def text_positions(num_tokens: int, start: int = 0, *, float_positions: bool = False) -> torch.Tensor:
    """(3, num_tokens) ids: every axis counts start, start+1, ..."""
    dtype = torch.float32 if float_positions else torch.long
    ids = torch.arange(num_tokens, dtype=dtype) + start
    return ids.unsqueeze(0).expand(3, -1).contiguous()


def media_grid_positions(
    grid_t: int,
    grid_h: int,
    grid_w: int,
    temporal_offset: float,
    *,
    reset_spatial: bool,
    fps: float | None,
    base_fps: float,
    compression: int,
    base_compression: int | None = None,
    start_frame: int = 0,
) -> torch.Tensor:
    """(3, grid_t * grid_h * grid_w) ids in (t, h, w) raster order.

    With ``fps`` given and more than one frame, t is rescaled so that one unit is one
    latent frame at ``base_fps``: t_i = (i + start_frame) / (fps / compression) *
    (base_fps / base_compression) + offset (floats). Otherwise t is an integer count.
    """
    base_compression = compression if base_compression is None else base_compression
    modulate = fps is not None and grid_t > 1
    if modulate:
        tokens_per_second = fps / compression
        base_tokens_per_second = base_fps / base_compression
        frames = torch.arange(grid_t, dtype=torch.float32) + start_frame
        t = frames / tokens_per_second * base_tokens_per_second + temporal_offset
    else:
        t = torch.arange(grid_t, dtype=torch.long) + int(temporal_offset) + start_frame
    t = t.view(-1, 1).expand(-1, grid_h * grid_w).flatten()
    h = torch.arange(grid_h, dtype=torch.long).view(1, -1, 1).expand(grid_t, -1, grid_w).flatten()
    w = torch.arange(grid_w, dtype=torch.long).view(1, 1, -1).expand(grid_t, grid_h, -1).flatten()
    if not reset_spatial:
        h = h + int(temporal_offset)
        w = w + int(temporal_offset)
    if modulate:
        return torch.stack([t, h.float(), w.float()])
    return torch.stack([t, h, w])


def generation_positions(
    config: Cosmos3Config,
    *,
    text_len: int,
    video_grid: tuple[int, int, int],
    fps: float,
    sound_len: int = 0,
    action_len: int = 0,
) -> torch.Tensor:
    """(3, N_gen) ids for [video tokens ; sound tokens ; action tokens].

    ``video_grid`` is the patch grid (T, ceil(H/p), ceil(W/p)); ``fps`` is the video
    frame rate. Mirrors diffusers' ``_prepare_{vision,sound,action}_segment``.
    """
    offset: float = text_len + config.unified_3d_mrope_temporal_modality_margin
    modulate = config.enable_fps_modulation
    parts = [
        media_grid_positions(
            *video_grid,
            offset,
            reset_spatial=config.unified_3d_mrope_reset_spatial_ids,
            fps=fps if modulate else None,
            base_fps=float(config.base_fps),
            compression=config.vae_temporal_compression,
        )
    ]
    if sound_len:
        parts.append(
            media_grid_positions(
                sound_len,
                1,
                1,
                offset,
                reset_spatial=config.unified_3d_mrope_reset_spatial_ids,
                fps=config.sound_latent_fps if modulate else None,
                base_fps=float(config.base_fps),
                compression=1,
            )
        )
    if action_len:
        # Actions are transitions: token i sits between latent frames, hence start_frame=1,
        # and their clock is the video frame rate measured against the latent-frame base.
        parts.append(
            media_grid_positions(
                action_len,
                1,
                1,
                offset,
                reset_spatial=config.unified_3d_mrope_reset_spatial_ids,
                fps=fps if modulate else None,
                base_fps=float(config.base_fps),
                compression=1,
                base_compression=config.vae_temporal_compression,
                start_frame=1,
            )
        )
    if any(p.dtype.is_floating_point for p in parts):
        parts = [p.float() for p in parts]
    return torch.cat(parts, dim=1)


def video_patch_grid(latent_shape: tuple[int, ...], patch: int) -> tuple[int, int, int]:
    """Patch grid (T, ceil(H/p), ceil(W/p)) of a (..., T, H, W) latent."""
    t, h, w = latent_shape[-3:]
    return t, math.ceil(h / patch), math.ceil(w / patch)
