"""The Cosmos 3 sound decoder (AVAE, Oobleck-style): 64-ch latents at 25/s -> 48 kHz stereo.

Decoder only (generation never encodes sound). Parameter names equal diffusers'
``Cosmos3AVAEAudioTokenizer`` decoder (``decoder.*``, weight-normalised convs stored as
``weight_g`` / ``weight_v``), so its decoder weights load with ``strict=True``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Cosmos3AudioDecoderConfig", "Cosmos3AudioDecoder"]

# diffusers config keys that only concern the encoder / unsupported variants; accepted and ignored.
_ENCODER_OR_FIXED_FIELDS = frozenset({
    "model_type", "stereo", "use_wav_as_input", "normalize_volume", "input_channels", "enc_type", "enc_dim",
    "enc_intermediate_dim", "enc_num_layers", "enc_num_blocks", "enc_n_fft", "enc_hop_length", "enc_latent_dim",
    "enc_c_mults", "enc_strides", "enc_identity_init", "enc_use_snake", "dec_type", "dec_use_snake", "dec_final_tanh",
    "dec_anti_aliasing", "dec_use_nearest_upsample", "dec_use_tanh_at_final", "bottleneck_type", "bottleneck",
    "activation", "snake_logscale", "anti_aliasing", "use_cuda_kernel", "causal", "padding_mode", "latent_mean",
    "latent_std", "encoder_enabled",
})


class Cosmos3AudioDecoderConfig(BaseModel):
    """Decoder architecture; field names are diffusers' ``Cosmos3AVAEAudioTokenizer`` config keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sampling_rate: int = Field(48000, gt=0)
    vocoder_input_dim: int = Field(64, gt=0)
    dec_dim: int = Field(320, gt=0)
    dec_c_mults: tuple[int, ...] = (1, 2, 4, 8, 16)
    dec_strides: tuple[int, ...] = (2, 4, 5, 6, 8)
    dec_out_channels: int = Field(2, gt=0)
    hop_size: int | None = None

    @model_validator(mode="after")
    def _check(self) -> "Cosmos3AudioDecoderConfig":
        if len(self.dec_c_mults) != len(self.dec_strides):
            raise ValueError(f"dec_c_mults {list(self.dec_c_mults)} and dec_strides {list(self.dec_strides)} need equal lengths")
        return self

    @property
    def hop(self) -> int:
        """Waveform samples per latent frame (1920 for the shipped 48 kHz / 25 Hz decoder)."""
        return self.hop_size if self.hop_size is not None else math.prod(self.dec_strides)

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any]) -> "Cosmos3AudioDecoderConfig":
        fields = {k: v for k, v in config.items() if not k.startswith("_") and k not in _ENCODER_OR_FIXED_FIELDS}
        return cls(**fields)

    @classmethod
    def tiny(cls) -> "Cosmos3AudioDecoderConfig":
        return cls(vocoder_input_dim=4, dec_dim=4, dec_c_mults=(1, 2), dec_strides=(2, 3), dec_out_channels=2)


class Snake1d(nn.Module):
    """x + sin^2(exp(alpha) x) / (exp(beta) + 1e-9), per channel (log-scale parameters)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha, beta = torch.exp(self.alpha), torch.exp(self.beta)
        return x + (beta + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class _WeightNormConv(nn.Module):
    """A conv whose weight is g * v / ||v|| (norm over every dim but 0), stored as weight_g / weight_v."""

    def __init__(self, weight_shape: tuple[int, ...], bias: bool, transpose: bool, **conv_kwargs: int) -> None:
        super().__init__()
        self.weight_g = nn.Parameter(torch.ones(weight_shape[0], *([1] * (len(weight_shape) - 1))))
        self.weight_v = nn.Parameter(torch.randn(weight_shape) * 0.02)
        out_channels = weight_shape[1] if transpose else weight_shape[0]
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.transpose = transpose
        self.conv_kwargs = conv_kwargs

    def weight(self) -> torch.Tensor:
        # torch's fused weight-norm primitive (what nn.utils.weight_norm evaluates), for bitwise parity.
        return torch._weight_norm(self.weight_v, self.weight_g, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transpose:
            return F.conv_transpose1d(x, self.weight(), self.bias, **self.conv_kwargs)
        return F.conv1d(x, self.weight(), self.bias, **self.conv_kwargs)


def _conv(cin: int, cout: int, kernel: int, *, bias: bool = True, dilation: int = 1, padding: int = 0) -> _WeightNormConv:
    return _WeightNormConv((cout, cin, kernel), bias, False, dilation=dilation, padding=padding)


class _ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = Snake1d(channels)
        self.conv1 = _conv(channels, channels, 7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake1d(channels)
        self.conv2 = _conv(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.snake2(self.conv1(self.snake1(x))))
        crop = (x.shape[-1] - y.shape[-1]) // 2
        if crop > 0:
            x = x[..., crop:-crop]
        return x + y


class _UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.snake1 = Snake1d(cin)
        self.conv_t1 = _WeightNormConv(
            (cin, cout, 2 * stride), True, True, stride=stride, padding=math.ceil(stride / 2), output_padding=stride % 2
        )
        self.res_unit1 = _ResidualUnit(cout, 1)
        self.res_unit2 = _ResidualUnit(cout, 3)
        self.res_unit3 = _ResidualUnit(cout, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_unit3(self.res_unit2(self.res_unit1(self.conv_t1(self.snake1(x)))))


class _Decoder(nn.Module):
    def __init__(self, c: Cosmos3AudioDecoderConfig) -> None:
        super().__init__()
        mults = (1, *c.dec_c_mults)
        strides = list(reversed(c.dec_strides))
        n = len(strides)
        self.conv1 = _conv(c.vocoder_input_dim, c.dec_dim * mults[-1], 7, padding=3)
        self.block = nn.ModuleList(
            _UpBlock(c.dec_dim * mults[n - i], c.dec_dim * mults[n - i - 1], stride) for i, stride in enumerate(strides)
        )
        self.snake1 = Snake1d(c.dec_dim)
        self.conv2 = _conv(c.dec_dim, c.dec_out_channels, 7, bias=False, padding=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


class Cosmos3AudioDecoder(nn.Module):
    """Sound latents (B, C, T) or (C, T) -> waveform (B, channels, N) or (channels, N), clamped to [-1, 1]."""

    def __init__(self, config: Cosmos3AudioDecoderConfig | None = None) -> None:
        super().__init__()
        self.config = config or Cosmos3AudioDecoderConfig()
        self.decoder = _Decoder(self.config)

    @property
    def sample_rate(self) -> int:
        return self.config.sampling_rate

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        squeeze = latents.ndim == 2
        if squeeze:
            latents = latents.unsqueeze(0)
        if latents.ndim != 3 or latents.shape[1] != self.config.vocoder_input_dim:
            raise ValueError(
                f"sound latents must be (B, {self.config.vocoder_input_dim}, T) or ({self.config.vocoder_input_dim}, T), "
                f"got {tuple(latents.shape)}"
            )
        audio = self.decoder(latents).clamp(-1.0, 1.0)
        return audio.squeeze(0) if squeeze else audio
