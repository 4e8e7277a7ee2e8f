"""Wan 2.1 / 2.2 causal video VAE (numerically matching diffusers' ``AutoencoderKLWan``).

The module holds weights only. Everything that lives for one call or one
stream -- the causal feature cache, tiling choice, batch slicing -- is an
argument, so one resident VAE can serve interleaved requests:

* ``CausalCache`` is the explicit, serialisable decoder history of one stream.
* ``decode_step`` decodes one latent frame (first -> 1 pixel frame, later ->
  ``temporal_compression`` frames); ``decode`` is the loop over it.
* ``TilingConfig`` turns on spatial tiling with linear blending per call (diffusers' tiling: approximate).
* ``HaloTiling`` decodes a whole video tile by tile with margins instead (exact: no blending), so
  only one tile's causal history and activations are alive at a time.

See ``vae_blocks`` for the layers and the cache-slot contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from fv_wan.models.vae_blocks import CausalConv3d, Decoder3d, EdgeCrop, Encoder3d, SlotAllocator, SlotList

__all__ = [
    "CausalCache",
    "HaloTile",
    "HaloTiling",
    "TilingConfig",
    "halo_reach",
    "WanVAE",
    "WanVAEConfig",
]

# Per-channel latent statistics shipped with the released checkpoints
# (Wan-AI/Wan2.1-T2V-*-Diffusers and Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

LOGVAR_CLAMP = (-30.0, 20.0)  # same clamp as diffusers' DiagonalGaussianDistribution


class WanVAEConfig(BaseModel):
    """Architecture of a Wan VAE; field names are diffusers' ``AutoencoderKLWan`` config keys.

    ``clip_output`` is ours (diffusers always clamps decoded video to [-1, 1]).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_dim: int = Field(96, gt=0)
    decoder_base_dim: int | None = Field(None, gt=0)
    z_dim: int = Field(16, gt=0)
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = Field(2, ge=1)
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    is_residual: bool = False
    in_channels: int = Field(3, gt=0)
    out_channels: int = Field(3, gt=0)
    patch_size: int | None = Field(None, ge=1)
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8
    clip_output: bool = True

    @model_validator(mode="after")
    def _check_consistency(self) -> WanVAEConfig:
        if not self.dim_mult or any(m <= 0 for m in self.dim_mult):
            raise ValueError(f"dim_mult must be a non-empty list of positive ints, got {list(self.dim_mult)}")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"temperal_downsample needs len(dim_mult) - 1 = {len(self.dim_mult) - 1} entries, "
                f"got {len(self.temperal_downsample)}"
            )
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) != self.z_dim:
                raise ValueError(f"{name} needs z_dim = {self.z_dim} values, got {len(getattr(self, name))}")
        if any(s <= 0 for s in self.latents_std):
            raise ValueError("latents_std values must all be > 0")
        patch_area = (self.patch_size or 1) ** 2
        for name in ("in_channels", "out_channels"):
            if getattr(self, name) % patch_area:
                raise ValueError(f"{name} ({getattr(self, name)}) must be divisible by patch_size**2 ({patch_area})")
        if self.scale_factor_spatial is not None and self.scale_factor_spatial != self.spatial_compression:
            raise ValueError(
                f"scale_factor_spatial={self.scale_factor_spatial} disagrees with the architecture: "
                f"2**(len(dim_mult)-1) * patch_size = {self.spatial_compression}"
            )
        if self.scale_factor_temporal is not None and self.scale_factor_temporal != self.temporal_compression:
            raise ValueError(
                f"scale_factor_temporal={self.scale_factor_temporal} disagrees with the architecture: "
                f"2**sum(temperal_downsample) = {self.temporal_compression}"
            )
        return self

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent pixel along H and W (8 for 2.1, 16 for 2.2)."""
        return 2 ** (len(self.dim_mult) - 1) * (self.patch_size or 1)

    @property
    def temporal_compression(self) -> int:
        """Pixel frames per latent frame after the first (4 for both)."""
        return 2 ** sum(self.temperal_downsample)

    @property
    def video_channels(self) -> int:
        return self.out_channels // (self.patch_size or 1) ** 2

    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any]) -> WanVAEConfig:
        """Build from a diffusers ``vae/config.json`` dict.

        Keys starting with ``_`` (``_class_name``, ``_diffusers_version`` ...) are
        metadata and skipped; any other key we do not know is an error.
        """
        values = {k: v for k, v in config.items() if not k.startswith("_")}
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise ValueError(
                f"Unknown Wan VAE config keys {unknown}; allowed keys are {sorted(cls.model_fields)}"
            )
        return cls(**values)

    def to_diffusers_config(self) -> dict[str, Any]:
        """The keyword arguments for diffusers' ``AutoencoderKLWan`` (drops fields diffusers lacks)."""
        out = self.model_dump(exclude={"clip_output"})
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out

    @classmethod
    def wan21(cls) -> WanVAEConfig:
        """Wan 2.1 VAE (all Wan 2.1 models and Wan 2.2 A14B): z 16, 8x spatial, 4x temporal."""
        return cls()

    @classmethod
    def wan22(cls) -> WanVAEConfig:
        """Wan 2.2 TI2V-5B VAE: z 48, residual shortcuts, patch 2, 16x spatial, 4x temporal."""
        return cls(
            base_dim=160,
            decoder_base_dim=256,
            z_dim=48,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_temporal=4,
            scale_factor_spatial=16,
            latents_mean=WAN22_LATENTS_MEAN,
            latents_std=WAN22_LATENTS_STD,
        )


class TilingConfig(BaseModel):
    """Spatial tiling for one encode/decode call, in pixel units (diffusers' names and defaults).

    Tiles overlap by ``min - stride`` pixels and are blended linearly there.
    Tiling triggers only when the input is larger than one tile.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tile_sample_min_height: int = Field(256, gt=0)
    tile_sample_min_width: int = Field(256, gt=0)
    tile_sample_stride_height: int = Field(192, gt=0)
    tile_sample_stride_width: int = Field(192, gt=0)

    @model_validator(mode="after")
    def _stride_within_tile(self) -> TilingConfig:
        for axis in ("height", "width"):
            stride = getattr(self, f"tile_sample_stride_{axis}")
            size = getattr(self, f"tile_sample_min_{axis}")
            if stride > size:
                raise ValueError(f"tile_sample_stride_{axis} ({stride}) must be <= tile_sample_min_{axis} ({size})")
        return self

    def require_multiple_of(self, unit: int, what: str) -> None:
        for name, value in self.model_dump().items():
            if value % unit:
                raise ValueError(f"TilingConfig.{name}={value} must be a multiple of {unit} for {what}")


class HaloTiling(BaseModel):
    """Exact spatial tiling of a whole-video :meth:`WanVAE.decode`: ``rows`` x ``columns`` tiles.

    The decoder's input conv and mid block (whose attention mixes a frame's pixels) run on whole
    frames first; then each tile runs the up stages through all frames with a margin as wide as
    those stages reach (``Decoder3d.halo_geometry``), dropped stage by stage as soon as nothing
    later reads it. Every output pixel is computed from the same inputs by the same layers as
    untiled, so nothing is blended; only one tile's causal history and activations are alive at
    a time, which is what lowers the peak. The margins cost extra compute at tile seams.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rows: int = Field(1, ge=1)
    columns: int = Field(1, ge=1)
    #: Widen each tile's range before the up stages below full resolution (but the first) to a multiple of
    #: this many pixels there: cuDNN's convs at 192 and 384 channels run faster per column at some widths.
    #: 16 took Wan 2.1's 81-frame 480x832 decode in 1x2 tiles from 1,130.7 to 1,112.2 ms on an H100
    #: (docs/benchmarks.md, "Exact halo tiles"). Exact at any value; 1 widens nothing.
    align: int = Field(16, ge=1, le=256)

    @property
    def count(self) -> int:
        return self.rows * self.columns

    def owned(self, height: int, width: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Each tile's (rows, columns) of a ``height`` x ``width`` latent, row-major; refuses a grid finer
        than the latent."""
        if self.rows > height or self.columns > width:
            raise ValueError(
                f"halo tiling of {self.rows} rows x {self.columns} columns needs at least one latent pixel "
                f"per tile; the latents are {height} x {width}"
            )
        return [(rows, columns) for rows in _even_split(height, self.rows) for columns in _even_split(width, self.columns)]


def halo_reach(config: WanVAEConfig) -> int:
    """``Decoder3d.halo_geometry()``'s reach at the decoder's first up stage, from the config alone (for
    admission estimates, which build no module): every up stage has ``num_res_blocks + 1`` residual blocks
    of two 3x3 convs, all but the last end in a 2x upsampler with a 3x3 conv, and a 3x3 conv closes."""
    stages = len(config.dim_mult)
    reach = 1
    for stage in reversed(range(stages)):
        if stage != stages - 1:
            reach = -(-(reach + 1) // 2)
        reach += 2 * (config.num_res_blocks + 1)
    return reach


@dataclass(frozen=True)
class HaloTile:
    """One tile of a :class:`HaloTiling`: the latent ``rows`` and ``columns`` it owns, the latent ``region``
    (top, bottom, left, right) it reads with its margins, and the crops ``Decoder3d.upper`` applies."""

    rows: tuple[int, int]
    columns: tuple[int, int]
    region: tuple[int, int, int, int]
    crops: tuple[EdgeCrop, ...]
    #: Video pixels per latent pixel.
    scale: int

    @property
    def output_top(self) -> int:
        return self.rows[0] * self.scale

    @property
    def output_left(self) -> int:
        return self.columns[0] * self.scale


def _even_split(size: int, parts: int) -> list[tuple[int, int]]:
    edges = [round(i * size / parts) for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _halo_axis(
    owned: tuple[int, int], size: int, scales: list[int], reaches: list[int], align: int = 1,
) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """One axis of a halo tile: the latent range it reads, and the (low, high) cuts before each up
    stage, before the output conv and from the output (``Decoder3d.upper``'s ``crops``).

    The ranges are found from the output backwards: at each boundary, what the rest of the decoder reads
    to compute the range after it (``reaches`` are the whole-rest reaches of ``Decoder3d.halo_geometry``;
    a stage's own reach is the difference). With ``align`` > 1 the range before each stage that runs
    below full resolution, but the first, is widened to a multiple of ``align`` pixels where the image
    allows; the ranges before it then cover the wider one. Widening only adds context: still exact.
    """
    lo, hi = owned
    last = len(scales) - 1
    out_lo, out_hi = lo * scales[-1], hi * scales[-1]
    regions: list[tuple[int, int]] = [(0, 0)] * len(scales)
    regions[last] = (max(0, out_lo - reaches[last]), min(size * scales[last], out_hi + reaches[last]))
    for b in range(last - 1, -1, -1):
        ratio = scales[b + 1] // scales[b]
        need_lo, need_hi = regions[b + 1]
        rest = reaches[b + 1]
        if ratio > 1:  # the upsampler's conv (radius 1) at the finer scale, then the nearest upsampling
            need_lo, need_hi = (need_lo - 1) // ratio, -(-(need_hi + 1) // ratio)
            rest = -(-(rest + 1) // ratio)
        own = reaches[b] - rest
        start, stop = max(0, need_lo - own), min(size * scales[b], need_hi + own)
        if align > 1 and 0 < b and scales[b] < scales[-1]:
            widen, limit = -(stop - start) % align, size * scales[b]
            add_high = min(widen // 2, limit - stop)  # both sides, as far as the image allows
            add_low = min(widen - add_high, start)
            add_high = min(widen - add_low, limit - stop)
            start, stop = start - add_low, stop + add_high
        regions[b] = (start, stop)
    cuts = [(0, 0)]
    for b in range(1, len(regions)):
        ratio = scales[b] // scales[b - 1]
        (prev_lo, prev_hi), (cur_lo, cur_hi) = regions[b - 1], regions[b]
        cuts.append((cur_lo - prev_lo * ratio, prev_hi * ratio - cur_hi))
    last_lo, last_hi = regions[-1]
    cuts.append((out_lo - last_lo, last_hi - out_hi))
    if any(a < 0 or b < 0 for a, b in cuts):  # a reach that grows faster than the upsampling
        raise ValueError(f"halo tiling: the decoder's reaches {reaches} at scales {scales} leave no margin to cut")
    return regions[0], cuts


@dataclass
class CausalCache:
    """Causal history of one decode stream: per spatial tile, one tensor slot per cached layer.

    ``tiles`` has one slot list when untiled, else one per tile in row-major
    order. ``steps_done`` counts decoded latent frames (0 = not started).
    ``decode_step`` updates the cache in place (so superseded history is freed
    immediately) and returns it.
    """

    tiles: list[SlotList] = field(default_factory=list)
    steps_done: int = 0

    def to_tensors(self, *, contiguous: bool = True) -> dict[str, Tensor]:
        """Flat ``name -> tensor`` dict; empty slots are omitted.

        With ``contiguous`` (the default) slots are packed to the default
        contiguous layout, as safetensors requires: a copy of every
        channels-last slot. ``contiguous=False`` hands the slots over as they
        are (``torch.save`` and :meth:`from_tensors` take any layout): the
        decode op does, since packing and unpacking the history on every step
        made a 448x832 decode 1.3x slower on the H200 (949 against 729 ms,
        ``bench/bench_decode_op.py``).
        """
        num_slots = len(self.tiles[0]) if self.tiles else 0
        out: dict[str, Tensor] = {
            "meta.steps_done": torch.tensor(self.steps_done, dtype=torch.int64),
            "meta.num_tiles": torch.tensor(len(self.tiles), dtype=torch.int64),
            "meta.num_slots": torch.tensor(num_slots, dtype=torch.int64),
        }
        for t, slots in enumerate(self.tiles):
            for s, value in enumerate(slots):
                if value is not None:
                    out[f"tile{t}.slot{s}"] = value.contiguous() if contiguous else value
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor]) -> CausalCache:
        try:
            steps_done = int(tensors["meta.steps_done"])
            num_tiles = int(tensors["meta.num_tiles"])
            num_slots = int(tensors["meta.num_slots"])
        except KeyError as err:
            raise ValueError(f"CausalCache.from_tensors: missing key {err.args[0]!r}") from None
        tiles: list[SlotList] = [[None] * num_slots for _ in range(num_tiles)]
        for name, value in tensors.items():
            if name.startswith("meta."):
                continue
            tile_part, _, slot_part = name.partition(".")
            if not (tile_part.startswith("tile") and slot_part.startswith("slot")):
                raise ValueError(f"CausalCache.from_tensors: unexpected key {name!r}")
            t, s = int(tile_part[4:]), int(slot_part[4:])
            if not (0 <= t < num_tiles and 0 <= s < num_slots):
                raise ValueError(f"CausalCache.from_tensors: key {name!r} outside {num_tiles} tiles x {num_slots} slots")
            tiles[t][s] = value
        return cls(tiles=tiles, steps_done=steps_done)

    def to(self, device: torch.device | str) -> CausalCache:
        """Move every slot to ``device`` (in place) and return self."""
        self.tiles = [[None if v is None else v.to(device) for v in slots] for slots in self.tiles]
        return self

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for slots in self.tiles for v in slots if v is not None)


@dataclass(frozen=True)
class _Tile:
    row: int
    col: int
    top: int  # in input units (latent pixels for decode, patchified pixels for encode)
    left: int


def _tile_grid(height: int, width: int, stride_h: int, stride_w: int) -> list[_Tile]:
    return [
        _Tile(r, c, top, left)
        for r, top in enumerate(range(0, height, stride_h))
        for c, left in enumerate(range(0, width, stride_w))
    ]


def _blend_weights(extent: int, like: Tensor) -> tuple[Tensor, Tensor]:
    ramp = torch.arange(extent, dtype=torch.float64) / extent
    return (1 - ramp).to(like.device, like.dtype), ramp.to(like.device, like.dtype)


class _TileBlender:
    """Blends tiles (fed in row-major order) and hands each tile's kept region to ``sink``.

    Same result as diffusers' blend_v/blend_h over the full tile grid (where
    blended tiles serve as neighbours), but only the overlap strips of the
    previous row and the previous tile are kept, not every decoded tile.
    """

    def __init__(
        self,
        stride: tuple[int, int],
        blend: tuple[int, int],
        out_size: tuple[int, int],
        sink: Callable[[Tensor, int, int], None],
    ) -> None:
        self.stride_h, self.stride_w = stride
        self.blend_h, self.blend_w = blend
        self.out_h, self.out_w = out_size
        self.sink = sink
        self.bottom_strips: dict[int, Tensor] = {}
        self.right_strip: Tensor | None = None

    def add(self, row: int, col: int, tile: Tensor) -> None:
        if row > 0 and self.blend_h > 0:
            above = self.bottom_strips[col]
            e = min(above.shape[-2], tile.shape[-2], self.blend_h)
            if e > 0:
                keep, take = _blend_weights(e, tile)
                tile[..., :e, :] = above[..., -e:, :] * keep[:, None] + tile[..., :e, :] * take[:, None]
        if col > 0 and self.blend_w > 0 and self.right_strip is not None:
            left = self.right_strip
            e = min(left.shape[-1], tile.shape[-1], self.blend_w)
            if e > 0:
                keep, take = _blend_weights(e, tile)
                tile[..., :e] = left[..., -e:] * keep + tile[..., :e] * take
        if self.blend_h > 0:
            self.bottom_strips[col] = tile[..., -self.blend_h :, :].clone()
        self.right_strip = tile[..., -self.blend_w :].clone() if self.blend_w > 0 else None
        top, left_px = row * self.stride_h, col * self.stride_w
        h = min(self.stride_h, tile.shape[-2], self.out_h - top)
        w = min(self.stride_w, tile.shape[-1], self.out_w - left_px)
        if h > 0 and w > 0:
            self.sink(tile[..., :h, :w], top, left_px)


class WanVAE(nn.Module):
    """Wan 2.1 / 2.2 VAE with diffusers-identical state-dict keys and numerics.

    Inputs are video in [-1, 1] shaped (B, 3, F, H, W) with F = 1 + 4k; latents
    are (B, z_dim, 1 + k, H/s, W/s). ``torch.no_grad`` is the caller's job.
    """

    def __init__(self, config: WanVAEConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or WanVAEConfig()
        z = config.z_dim
        encoder_slots, decoder_slots = SlotAllocator(), SlotAllocator()
        self.encoder = Encoder3d(
            in_channels=config.in_channels,
            dim=config.base_dim,
            z_dim=2 * z,
            dim_mult=config.dim_mult,
            num_res_blocks=config.num_res_blocks,
            attn_scales=config.attn_scales,
            temperal_downsample=config.temperal_downsample,
            dropout=config.dropout,
            is_residual=config.is_residual,
            slots=encoder_slots,
        )
        self.quant_conv = CausalConv3d(2 * z, 2 * z, 1)
        self.post_quant_conv = CausalConv3d(z, z, 1)
        self.decoder = Decoder3d(
            dim=config.decoder_base_dim or config.base_dim,
            z_dim=z,
            dim_mult=config.dim_mult,
            num_res_blocks=config.num_res_blocks,
            temperal_upsample=config.temperal_downsample[::-1],
            dropout=config.dropout,
            out_channels=config.out_channels,
            is_residual=config.is_residual,
            slots=decoder_slots,
        )
        self.num_encoder_slots = encoder_slots.count
        self.num_decoder_slots = decoder_slots.count

    def set_fused_ops(self, fused_ops: Any) -> None:
        """Decode with each norm + SiLU as one fused pass (a kernel ``FusedOps``); None: the eager code.

        Only the decoder uses them; the encoder stays eager.
        """
        if self.decoder is None:
            raise ValueError("set_fused_ops: this WanVAE holds no decoder (it was loaded as the encoder half)")
        self.decoder.set_fused_ops(fused_ops)

    def set_decode_frame_chunk(self, frames: int | None) -> None:
        """Run the decoder's full-resolution stages (after its last temporal upsampler) ``frames``
        frames at a time; None (the default) runs a step's frames at once. Exact: only the live
        activations shrink, the video is the same.
        """
        if self.decoder is None:
            raise ValueError("set_decode_frame_chunk: this WanVAE holds no decoder (it was loaded as the encoder half)")
        self.decoder.set_frame_chunk(frames)

    # ------------------------------------------------------------------ helpers

    @property
    def spatial_compression(self) -> int:
        return self.config.spatial_compression

    @property
    def temporal_compression(self) -> int:
        return self.config.temporal_compression

    @property
    def _patch(self) -> int:
        return self.config.patch_size or 1

    def num_frames_for(self, latent_frames: int) -> int:
        """Pixel frames decoded from ``latent_frames`` latent frames."""
        return 1 + self.temporal_compression * (latent_frames - 1)

    def _patchify(self, x: Tensor) -> Tensor:
        p = self._patch
        if p == 1:
            return x
        b, c, f, h, w = x.shape
        # Channel order (c, pw, ph) as in diffusers' patchify.
        x = x.view(b, c, f, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
        return x.reshape(b, c * p * p, f, h // p, w // p)

    def _write_video(self, out: Tensor, y: Tensor, frame0: int, top: int = 0, left: int = 0) -> None:
        """Copy patchified decoder output ``y`` into video ``out`` (unpatchifying on the way)."""
        p = self._patch
        b, cp, f, h, w = y.shape
        region = out[:, :, frame0 : frame0 + f, top * p : (top + h) * p, left * p : (left + w) * p]
        if p == 1:
            region.copy_(y)
            return
        c = cp // (p * p)
        region.view(b, c, f, h, p, w, p).copy_(y.view(b, c, p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2))

    def _latent_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        shape = (1, self.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean, dtype=like.dtype, device=like.device).view(shape)
        std = torch.tensor(self.config.latents_std, dtype=like.dtype, device=like.device).view(shape)
        return mean, std

    def _check_latents(self, z: Tensor, name: str) -> None:
        if z.dim() != 5 or z.shape[1] != self.config.z_dim:
            raise ValueError(f"{name} must be (B, {self.config.z_dim}, T, h, w), got {tuple(z.shape)}")

    # ------------------------------------------------------------ normalisation

    def normalize_latents(self, z: Tensor) -> Tensor:
        """(z - mean) / std per channel: raw VAE latents -> the diffusion model's space."""
        self._check_latents(z, "z")
        mean, std = self._latent_stats(z)
        return (z - mean) / std

    def denormalize_latents(self, z: Tensor) -> Tensor:
        """z * std + mean per channel: diffusion-model latents -> raw VAE latents."""
        self._check_latents(z, "z")
        mean, std = self._latent_stats(z)
        return z * std + mean

    # ------------------------------------------------------------------ encode

    def encode(
        self, video: Tensor, *, tiling: TilingConfig | None = None, slicing: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Video (B, 3, F, H, W) in [-1, 1] -> posterior ``(mean, logvar)``, each (B, z, T, h, w).

        Frame 0 is encoded alone, then chunks of ``temporal_compression`` frames.
        ``logvar`` is clamped to [-30, 20] like diffusers' posterior.
        """
        c = self.config
        if video.dim() != 5 or video.shape[1] != c.in_channels // self._patch**2:
            raise ValueError(f"video must be (B, {c.in_channels // self._patch**2}, F, H, W), got {tuple(video.shape)}")
        frames, height, width = video.shape[2:]
        if (frames - 1) % self.temporal_compression:
            raise ValueError(f"video frames must be 1 + {self.temporal_compression}k, got {frames}")
        if height % self.spatial_compression or width % self.spatial_compression:
            raise ValueError(f"video H and W must be multiples of {self.spatial_compression}, got {height}x{width}")
        if slicing and video.shape[0] > 1:
            moments = torch.cat([self._encode_moments(v, tiling) for v in video.split(1)])
        else:
            moments = self._encode_moments(video, tiling)
        mean, logvar = moments.chunk(2, dim=1)
        return mean, logvar.clamp(*LOGVAR_CLAMP)

    def encode_latent(
        self,
        video: Tensor,
        sample: bool = False,
        generator: torch.Generator | None = None,
        *,
        tiling: TilingConfig | None = None,
        slicing: bool = False,
    ) -> Tensor:
        """Raw (un-normalised) latents: the posterior mean, or a sample from it."""
        mean, logvar = self.encode(video, tiling=tiling, slicing=slicing)
        if not sample:
            return mean
        # Draw on the generator's device when it is a CPU generator (as diffusers does).
        noise_device = generator.device if generator is not None and generator.device.type == "cpu" else mean.device
        noise = torch.randn(mean.shape, generator=generator, device=noise_device, dtype=mean.dtype).to(mean.device)
        return mean + torch.exp(0.5 * logvar) * noise

    def _encode_chunks(self, x: Tensor) -> Tensor:
        """Patchified video -> quantised moments, through one fresh causal cache."""
        cache: SlotList = [None] * self.num_encoder_slots
        step = self.temporal_compression
        chunks = [x[:, :, :1]] + [x[:, :, i : i + step] for i in range(1, x.shape[2], step)]
        return torch.cat([self.quant_conv(self.encoder(chunk, cache)) for chunk in chunks], dim=2)

    def _encode_moments(self, video: Tensor, tiling: TilingConfig | None) -> Tensor:
        height, width = video.shape[-2:]
        x = self._patchify(video)
        if tiling is None or (width <= tiling.tile_sample_min_width and height <= tiling.tile_sample_min_height):
            return self._encode_chunks(x)
        return self._encode_tiled(x, tiling)

    def _encode_tiled(self, x: Tensor, tiling: TilingConfig) -> Tensor:
        # As in diffusers, tile sizes are applied to the *patchified* input.
        ratio = self.spatial_compression // self._patch
        tiling.require_multiple_of(ratio, "encoding")
        b, _, frames, height, width = x.shape
        th, tw = tiling.tile_sample_min_height, tiling.tile_sample_min_width
        sh, sw = tiling.tile_sample_stride_height, tiling.tile_sample_stride_width
        out = x.new_empty((b, 2 * self.config.z_dim, 1 + (frames - 1) // self.temporal_compression, height // ratio, width // ratio))

        def sink(region: Tensor, top: int, left: int) -> None:
            out[..., top : top + region.shape[-2], left : left + region.shape[-1]].copy_(region)

        blender = _TileBlender((sh // ratio, sw // ratio), ((th - sh) // ratio, (tw - sw) // ratio), out.shape[-2:], sink)
        for tile in _tile_grid(height, width, sh, sw):
            blender.add(tile.row, tile.col, self._encode_chunks(x[..., tile.top : tile.top + th, tile.left : tile.left + tw]))
        return out

    # ------------------------------------------------------------------ decode

    def _decode_latent_frame(self, z_frame: Tensor, slots: SlotList, first: bool) -> Tensor:
        """One latent frame -> patchified pixel frames (1 if first, else temporal_compression)."""
        return self.decoder(self.post_quant_conv(z_frame), slots, first)

    def _decode_tiling(self, z: Tensor, tiling: TilingConfig | None) -> TilingConfig | None:
        """The tiling to use for latents ``z``: None unless they exceed one tile."""
        if tiling is None:
            return None
        s = self.spatial_compression
        h, w = z.shape[-2:]
        if w <= tiling.tile_sample_min_width // s and h <= tiling.tile_sample_min_height // s:
            return None
        tiling.require_multiple_of(s, "decoding")
        return tiling

    def _latent_tiles(self, z: Tensor, tiling: TilingConfig) -> tuple[list[_Tile], tuple[int, int]]:
        s = self.spatial_compression
        tiles = _tile_grid(z.shape[-2], z.shape[-1], tiling.tile_sample_stride_height // s, tiling.tile_sample_stride_width // s)
        return tiles, (tiling.tile_sample_min_height // s, tiling.tile_sample_min_width // s)

    def _decode_blender(self, out: Tensor, tiling: TilingConfig, frame0: int) -> _TileBlender:
        """Blender in patchified pixel space writing unpatchified pixels into ``out``."""
        p = self._patch
        stride = (tiling.tile_sample_stride_height // p, tiling.tile_sample_stride_width // p)
        blend = (
            tiling.tile_sample_min_height // p - stride[0],
            tiling.tile_sample_min_width // p - stride[1],
        )
        size = (out.shape[-2] // p, out.shape[-1] // p)
        return _TileBlender(stride, blend, size, lambda y, top, left: self._write_video(out, y, frame0, top, left))

    def _new_video(self, z: Tensor, frames: int) -> Tensor:
        s = self.spatial_compression
        return z.new_empty((z.shape[0], self.config.video_channels, frames, z.shape[-2] * s, z.shape[-1] * s))

    def decode(
        self, z: Tensor, *, tiling: TilingConfig | None = None, slicing: bool = False, halo: HaloTiling | None = None
    ) -> Tensor:
        """Raw latents (B, z, T, h, w) -> video (B, 3, 1 + 4(T-1), h*s, w*s), clamped to [-1, 1].

        Untiled, this is exactly the loop over :meth:`decode_step`. Tiled, tiles
        are decoded one after another through all frames (one tile's cache alive
        at a time) and blended straight into the output. With ``halo`` the tiles
        are exact instead (:class:`HaloTiling`); it excludes ``tiling``.
        """
        self._check_latents(z, "z")
        tiles: list[HaloTile] | None = None
        if halo is not None:
            if tiling is not None:
                raise ValueError("decode: tiling (blended tiles) and halo (exact tiles) exclude each other; pass one")
            tiles = self.halo_tiles(z.shape[-2], z.shape[-1], halo)  # refuses a grid finer than the latents
        out = self._new_video(z, self.num_frames_for(z.shape[2]))
        batches = z.split(1) if slicing and z.shape[0] > 1 else [z]
        start = 0
        for zb in batches:
            target = out[start : start + zb.shape[0]]
            if tiles is not None:
                lower = self.decode_lower(zb)
                for tile in tiles:  # straight into the video: no tile-sized copy is alive
                    self.decode_halo_tile(lower, tile, out=target)
                del lower
            else:
                self._decode_into(zb, target, self._decode_tiling(zb, tiling))
            start += zb.shape[0]
        if self.config.clip_output:
            out.clamp_(-1.0, 1.0)
        return out

    def decode_lower(self, z: Tensor) -> Tensor:
        """The decoder's whole-frame part (post-quant conv, input conv, mid block) for every latent frame:
        (B, C, T, h, w), what :meth:`decode_halo_tile` decodes tile by tile."""
        self._check_latents(z, "z")
        cache: SlotList = [None] * self.num_decoder_slots
        out: Tensor | None = None
        for k in range(z.shape[2]):
            x = self.decoder.lower(self.post_quant_conv(z[:, :, k : k + 1]), cache)
            if out is None:
                out = torch.empty((*x.shape[:2], z.shape[2], *x.shape[3:]), dtype=x.dtype, device=x.device,
                                  memory_format=torch.channels_last_3d)
            out[:, :, k : k + 1].copy_(x)
        assert out is not None
        return out

    def halo_tiles(self, height: int, width: int, halo: HaloTiling) -> list[HaloTile]:
        """The tiles of a ``height`` x ``width`` latent in row-major order, each with its margins."""
        scales, reaches = self.decoder.halo_geometry()
        tiles = []
        for rows, columns in halo.owned(height, width):
            (top, bottom), row_cuts = _halo_axis(rows, height, scales, reaches, halo.align)
            (left, right), column_cuts = _halo_axis(columns, width, scales, reaches, halo.align)
            tiles.append(HaloTile(
                rows=rows, columns=columns, region=(top, bottom, left, right), scale=scales[-1] * self._patch,
                crops=tuple(EdgeCrop(r[0], r[1], c[0], c[1]) for r, c in zip(row_cuts, column_cuts)),
            ))  # fmt: skip
        return tiles

    def decode_halo_tile(self, lower: Tensor, tile: HaloTile, *, out: Tensor | None = None) -> Tensor:
        """One halo tile through all frames from :meth:`decode_lower`'s output: the video of the tile's own
        pixels (B, C, F, H_tile, W_tile), not clamped, decoded with a fresh causal history for the tile.
        With ``out`` (the whole video) the tile is written into its place there, and ``out`` is returned."""
        top, bottom, left, right = tile.region
        p = self._patch
        offset = (tile.output_top // p, tile.output_left // p) if out is not None else (0, 0)
        cache: SlotList = [None] * self.num_decoder_slots
        frame0 = 0
        for k in range(lower.shape[2]):
            region = lower[:, :, k : k + 1, top:bottom, left:right].contiguous(memory_format=torch.channels_last_3d)
            y = self.decoder.upper(region, cache, k == 0, tile.crops)
            del region
            if out is None:
                out = y.new_empty((y.shape[0], self.config.video_channels, self.num_frames_for(lower.shape[2]),
                                   y.shape[3] * p, y.shape[4] * p))  # fmt: skip
            self._write_video(out, y, frame0, *offset)
            frame0 += y.shape[2]
        assert out is not None
        return out

    def _decode_into(self, z: Tensor, out: Tensor, tiling: TilingConfig | None) -> None:
        if tiling is None:
            cache = self.new_decode_cache()
            frame0 = 0
            for k in range(z.shape[2]):
                count = self._frames_of_step(k)
                self._step(z[:, :, k : k + 1], cache, None, out[:, :, frame0 : frame0 + count])
                frame0 += count
            return
        tiles, (th, tw) = self._latent_tiles(z, tiling)
        blender = self._decode_blender(out, tiling, 0)
        num_frames = out.shape[2]
        for tile in tiles:
            z_tile = z[..., tile.top : tile.top + th, tile.left : tile.left + tw]
            slots: SlotList = [None] * self.num_decoder_slots
            tile_out: Tensor | None = None
            frame0 = 0
            for k in range(z.shape[2]):
                y = self._decode_latent_frame(z_tile[:, :, k : k + 1], slots, k == 0)
                if tile_out is None:
                    tile_out = y.new_empty((*y.shape[:2], num_frames, *y.shape[3:]))
                tile_out[:, :, frame0 : frame0 + y.shape[2]].copy_(y)
                frame0 += y.shape[2]
            slots.clear()  # free this tile's history before blending
            assert tile_out is not None
            blender.add(tile.row, tile.col, tile_out)

    def _frames_of_step(self, step: int) -> int:
        return 1 if step == 0 else self.temporal_compression

    def new_decode_cache(self) -> CausalCache:
        """An empty cache for a new decode stream (its slots are sized on the first step)."""
        return CausalCache()

    def decode_step(
        self, z_frame: Tensor, cache: CausalCache, *, tiling: TilingConfig | None = None
    ) -> tuple[Tensor, CausalCache]:
        """Decode one raw latent frame (B, z, 1, h, w) of a stream.

        Returns the new pixel frames (1 for the stream's first latent frame,
        else ``temporal_compression``), clamped like :meth:`decode`, and the
        cache, updated in place. With ``tiling`` every tile keeps its own
        history in the cache, so the tiling must stay the same for the stream.
        """
        self._check_latents(z_frame, "z_frame")
        if z_frame.shape[2] != 1:
            raise ValueError(f"z_frame must hold exactly one latent frame, got {z_frame.shape[2]}")
        frames, cache = self._step(z_frame, cache, self._decode_tiling(z_frame, tiling))
        if self.config.clip_output:
            frames.clamp_(-1.0, 1.0)
        return frames, cache

    def decode_chunk(
        self, z_chunk: Tensor, cache: CausalCache, *, tiling: TilingConfig | None = None
    ) -> tuple[Tensor, CausalCache]:
        """Decode a chunk of raw latent frames (B, z, F, h, w) of a stream, continuing ``cache``.

        A causal (chunk-wise) generator's decode: chunk after chunk with one cache equals
        one :meth:`decode` of the concatenated latents. Returns the chunk's pixel frames
        (``1 + 4 (F - 1)`` for the stream's first chunk, else ``4 F`` with the Wan 2.1 VAE)
        and the cache, updated in place.
        """
        self._check_latents(z_chunk, "z_chunk")
        if z_chunk.shape[2] < 1:
            raise ValueError("z_chunk must hold at least one latent frame")
        frames = [self.decode_step(z_chunk[:, :, k : k + 1], cache, tiling=tiling)[0] for k in range(z_chunk.shape[2])]
        return torch.cat(frames, dim=2), cache

    def _step(
        self, z_frame: Tensor, cache: CausalCache, tiling: TilingConfig | None, out: Tensor | None = None
    ) -> tuple[Tensor, CausalCache]:
        """Decode one latent frame into ``out`` (allocated when None), advancing ``cache``."""
        tiles, (th, tw) = (
            self._latent_tiles(z_frame, tiling) if tiling is not None else ([_Tile(0, 0, 0, 0)], z_frame.shape[-2:])
        )
        if cache.steps_done == 0:
            cache.tiles = [[None] * self.num_decoder_slots for _ in tiles]
        elif len(cache.tiles) != len(tiles) or any(len(slots) != self.num_decoder_slots for slots in cache.tiles):
            raise ValueError(
                f"CausalCache holds {len(cache.tiles)} tile(s) but this step needs {len(tiles)} tile(s) of "
                f"{self.num_decoder_slots} slots; a stream must keep the same latent size, tiling and model"
            )
        first = cache.steps_done == 0
        if out is None:
            out = self._new_video(z_frame, self._frames_of_step(cache.steps_done))
        if tiling is None:
            self._write_video(out, self._decode_latent_frame(z_frame, cache.tiles[0], first), 0)
        else:
            blender = self._decode_blender(out, tiling, 0)
            for tile, slots in zip(tiles, cache.tiles):
                z_tile = z_frame[..., tile.top : tile.top + th, tile.left : tile.left + tw]
                blender.add(tile.row, tile.col, self._decode_latent_frame(z_tile, slots, first))
        cache.steps_done += 1
        return out, cache

    def iter_decode(
        self, z: Tensor, *, tiling: TilingConfig | None = None
    ) -> Iterator[Tensor]:
        """Yield decoded pixel frames latent frame by latent frame (for previews/streaming)."""
        cache = self.new_decode_cache()
        for k in range(z.shape[2]):
            frames, cache = self.decode_step(z[:, :, k : k + 1], cache, tiling=tiling)
            yield frames
