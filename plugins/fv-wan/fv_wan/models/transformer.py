"""Wan 2.1 / 2.2 video DiT.

Numerically equivalent to diffusers' ``WanTransformer3DModel`` (0.42) and with the
same state-dict keys, so a diffusers checkpoint loads without a key map. The
original Wan release layout loads through :func:`convert_original_state_dict`.

The forward is split into ``prepare`` -> ``run_block`` x N -> ``finish`` so runtime
plugins (block caches, offloaders, profilers) can drive the block loop through a
``block_runner`` instead of monkeypatching. Attention is a swappable callable on
(B, heads, L, head_dim) tensors; the runtime picks the backend.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator
from torch import nn

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: Self-attention over a video token grid with a compression gate (a ``needs_video_grid`` driver's
#: ``attend_video``): ``fn(q, k, v, *, grid=(F, H, W), gate=g)``, all (B, heads, L, head_dim).
VideoAttentionFn = Callable[..., torch.Tensor]
#: A ``fv_kernel.compute.fused.FusedOps`` (duck-typed: the model never imports the kernel's compute
#: package). None keeps the eager code path, bit-identical to diffusers.
FusedOps = Any
BlockRunner = Callable[["WanTransformer", torch.Tensor, "WanBlockInputs"], torch.Tensor]

#: Text context length of the UMT5 encoder. diffusers hardcodes it to find the image
#: tokens in the I2V context: they are the first ``L - 512`` tokens.
TEXT_CONTEXT_LENGTH = 512

#: Module names (dot-separated path components) whose weights stay in fp32 at inference,
#: as diffusers' ``WanTransformer3DModel._keep_in_fp32_modules``.
KEEP_IN_FP32_MODULES: tuple[str, ...] = ("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")

#: Keys that old diffusers checkpoints carry but the model never uses (diffusers ignores them too).
IGNORED_CHECKPOINT_KEY_PATTERN = re.compile(r"(^|\.)norm_added_q\.")


class WanConfigError(ValueError):
    """A Wan transformer config that cannot describe a valid model."""


class WanStateDictError(KeyError):
    """A state dict whose keys do not fit the Wan transformer layout."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------- config


class WanTransformerConfig(BaseModel):
    """Transformer hyper-parameters, with diffusers' ``config.json`` field names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    patch_size: tuple[PositiveInt, PositiveInt, PositiveInt] = (1, 2, 2)
    num_attention_heads: PositiveInt = 40
    attention_head_dim: PositiveInt = 128
    in_channels: PositiveInt = 16
    out_channels: PositiveInt = 16
    text_dim: PositiveInt = 4096
    freq_dim: PositiveInt = 256
    ffn_dim: PositiveInt = 13824
    num_layers: PositiveInt = 40
    cross_attn_norm: bool = True
    qk_norm: Literal["rms_norm_across_heads"] = "rms_norm_across_heads"
    eps: PositiveFloat = 1e-6
    image_dim: PositiveInt | None = None
    added_kv_proj_dim: PositiveInt | None = None
    rope_max_seq_len: PositiveInt = 1024
    pos_embed_seq_len: PositiveInt | None = None
    #: Self-attention layers carry ``attn1.to_gate_compress`` (dim -> dim, with bias): the gate of
    #: Video Sparse Attention's compression branch, which VSA-trained checkpoints (FastWan) hold.
    has_gate_compress: bool = False

    @model_validator(mode="before")
    @classmethod
    def _default_out_channels(cls, data: Any) -> Any:
        # diffusers: ``out_channels = out_channels or in_channels``
        if isinstance(data, dict) and data.get("out_channels", 0) is None:
            data = {**data, "out_channels": data.get("in_channels", 16)}
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> WanTransformerConfig:
        if self.attention_head_dim % 2 or self.attention_head_dim < 6:
            raise WanConfigError(
                f"attention_head_dim must be even and >= 6 for the 3-axis RoPE split, got {self.attention_head_dim}"
            )
        if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.inner_dim:
            raise WanConfigError(
                f"added_kv_proj_dim must equal num_attention_heads * attention_head_dim = {self.inner_dim} "
                f"(the image tokens are projected to the model width first), got {self.added_kv_proj_dim}"
            )
        if self.pos_embed_seq_len is not None and self.image_dim is None:
            raise WanConfigError("pos_embed_seq_len requires image_dim (it is the image embedder's position table)")
        return self

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any]) -> WanTransformerConfig:
        """Build from a diffusers ``config.json`` dict; ``_``-prefixed metadata keys are ignored."""
        fields = {key: value for key, value in config.items() if not key.startswith("_")}
        unknown = sorted(set(fields) - set(cls.model_fields))
        if unknown:
            raise WanConfigError(
                f"unknown WanTransformer3DModel config keys {unknown}; allowed keys: {sorted(cls.model_fields)}"
            )
        if isinstance(fields.get("patch_size"), list):
            fields["patch_size"] = tuple(fields["patch_size"])
        return cls(**fields)

    def to_diffusers_config(self) -> dict[str, Any]:
        """Keyword arguments for diffusers' ``WanTransformer3DModel(**kwargs)``. diffusers has no VSA
        gate: ``has_gate_compress`` appears only when true (a gated model is not a diffusers model)."""
        return self.model_dump(exclude=None if self.has_gate_compress else {"has_gate_compress"})

    # Released checkpoints. All use head_dim 128, patch (1,2,2), text_dim 4096, freq_dim 256.
    @classmethod
    def wan21_t2v_1_3b(cls) -> WanTransformerConfig:
        return cls(num_attention_heads=12, num_layers=30, ffn_dim=8960)

    @classmethod
    def wan21_t2v_14b(cls) -> WanTransformerConfig:
        return cls(num_attention_heads=40, num_layers=40, ffn_dim=13824)

    @classmethod
    def wan21_i2v_14b(cls) -> WanTransformerConfig:
        return cls(
            num_attention_heads=40, num_layers=40, ffn_dim=13824,
            in_channels=36, out_channels=16, image_dim=1280, added_kv_proj_dim=5120,
        )  # fmt: skip

    @classmethod
    def wan22_ti2v_5b(cls) -> WanTransformerConfig:
        return cls(num_attention_heads=24, num_layers=30, ffn_dim=14336, in_channels=48, out_channels=48)

    @classmethod
    def tiny(cls, *, image: bool = False, in_channels: int = 16, out_channels: int = 16) -> WanTransformerConfig:
        """A 2-layer model for tests and the embedded tiny card (text_dim 32 = tiny UMT5 width)."""
        return cls(
            num_attention_heads=2, attention_head_dim=12, in_channels=in_channels, out_channels=out_channels,
            text_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
            image_dim=16 if image else None, added_kv_proj_dim=24 if image else None,
        )  # fmt: skip

    @classmethod
    def preset(cls, name: str) -> WanTransformerConfig:
        factory = PRESETS.get(name)
        if factory is None:
            raise WanConfigError(f"unknown Wan transformer preset {name!r}; allowed: {sorted(PRESETS)}")
        return factory()


PRESETS: Mapping[str, Callable[[], WanTransformerConfig]] = MappingProxyType(
    {
        "wan2.1-t2v-1.3b": WanTransformerConfig.wan21_t2v_1_3b,
        "wan2.1-t2v-14b": WanTransformerConfig.wan21_t2v_14b,
        "wan2.1-i2v-14b": WanTransformerConfig.wan21_i2v_14b,
        "wan2.2-ti2v-5b": WanTransformerConfig.wan22_ti2v_5b,
    }
)


# --------------------------------------------------------------------------- numerics helpers


def _fp32_layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm computed (and returned) in fp32 whatever the input/weight dtype."""
    weight = norm.weight.float() if norm.weight is not None else None
    bias = norm.bias.float() if norm.bias is not None else None
    return F.layer_norm(x.float(), norm.normalized_shape, weight, bias, norm.eps)


def timestep_sinusoid(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """[cos | sin] sinusoidal embedding of 1-D timesteps (flip_sin_to_cos, no frequency shift), fp32."""
    half = dim // 2
    # Same op order as diffusers' get_timestep_embedding, for bitwise-equal tables.
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    frequencies = torch.exp(exponent / half)
    angles = timesteps[:, None].float() * frequencies[None, :]
    embedding = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        embedding = F.pad(embedding, (0, 1))
    return embedding


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[..., 0::2], x[..., 1::2]) of x (B, L, H, D) by (L, 1, D/2) tables."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    # Math in the tables' fp32, each half rounded once to x's dtype before interleaving (no fp32 stack pass).
    rotated = torch.stack(((even * cos - odd * sin).to(x.dtype), (even * sin + odd * cos).to(x.dtype)), dim=-1)
    return rotated.flatten(-2)


# --------------------------------------------------------------------------- modules


def _scaled_randn(*shape: int) -> torch.Tensor:
    """randn / sqrt(last dim); on the meta device an empty tensor of the shape (randn and arithmetic
    on meta run torch's Python decompositions, whose first use imports torch._dynamo and sympy:
    about 2 s of a cold start)."""
    if torch.get_default_device().type == "meta":
        return torch.empty(*shape)
    return torch.randn(*shape) / shape[-1] ** 0.5


class WanRotaryEmbedding(nn.Module):
    """3-axis RoPE tables: head dim split t/h/w = d-4(d//6), 2(d//6), 2(d//6); theta 10000, float64 math."""

    def __init__(self, attention_head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        spatial = 2 * (attention_head_dim // 6)
        self.axis_dims: tuple[int, int, int] = (attention_head_dim - 2 * spatial, spatial, spatial)
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.build_tables()

    def build_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables; call after materialising a model built on the meta device."""
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type == "meta":
            # Shapes only: arange on meta goes through torch._refs, whose first use imports
            # torch._dynamo and sympy (about 2 s of a cold start) for tables that hold no values.
            shape = (self.max_seq_len, sum(self.axis_dims) // 2)
            self.register_buffer("cos_table", torch.empty(shape, device=target), persistent=False)
            self.register_buffer("sin_table", torch.empty(shape, device=target), persistent=False)
            return
        positions = torch.arange(self.max_seq_len, dtype=torch.float64, device=device)
        angles = []
        for dim in self.axis_dims:
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
            angles.append(torch.outer(positions, inv_freq))
        table = torch.cat(angles, dim=1)  # (max_seq_len, head_dim // 2)
        # Non-persistent: diffusers' checkpoints carry no RoPE tables.
        self.register_buffer("cos_table", table.cos().float(), persistent=False)
        self.register_buffer("sin_table", table.sin().float(), persistent=False)

    def forward(self, grid_sizes: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (F*H*W, 1, head_dim // 2), fp32, for a (F, H, W) token grid."""
        if max(grid_sizes) > self.max_seq_len:
            raise ValueError(f"token grid {grid_sizes} exceeds rope_max_seq_len={self.max_seq_len}")
        frames, height, width = grid_sizes
        halves = [dim // 2 for dim in self.axis_dims]
        outputs = []
        for table in (self.cos_table.float(), self.sin_table.float()):
            t_part, h_part, w_part = table.split(halves, dim=1)
            grid = torch.cat(
                [
                    t_part[:frames, None, None, :].expand(frames, height, width, -1),
                    h_part[None, :height, None, :].expand(frames, height, width, -1),
                    w_part[None, None, :width, :].expand(frames, height, width, -1),
                ],
                dim=-1,
            )
            outputs.append(grid.reshape(frames * height * width, 1, -1))
        return outputs[0], outputs[1]


class _TwoLayerMLP(nn.Module):
    """linear_1 -> activation -> linear_2 (diffusers' TimestepEmbedding / PixArtAlphaTextProjection)."""

    def __init__(self, in_dim: int, hidden_dim: int, activation: nn.Module) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, hidden_dim)
        self.act = activation
        self.linear_2 = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class _GeluProjection(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, approximate: Literal["none", "tanh"]) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate=self.approximate)


class _FeedForward(nn.Module):
    """GELU MLP laid out as diffusers' FeedForward: ``net.0.proj`` and ``net.2`` (``net.1`` is dropout)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, approximate: Literal["none", "tanh"]) -> None:
        super().__init__()
        self.net = nn.ModuleList(
            [_GeluProjection(in_dim, hidden_dim, approximate), nn.Identity(), nn.Linear(hidden_dim, out_dim)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))

    def forward_fused(self, x: Any, ops: FusedOps) -> torch.Tensor:
        """:meth:`forward` with the GELU's output quantized for an fp8 ``net.2`` in the GELU's pass (``ops.gelu_tanh_fp8``).
        ``x``: a tensor, or the quantized rows an fp8 ``net.0.proj`` takes."""
        hidden = self.net[0].proj(x)
        if self.net[0].approximate == "tanh" and ops.takes_quantized_rows(self.net[2]):
            return self.net[2](ops.gelu_tanh_fp8(hidden))
        return self.net[2](F.gelu(hidden, approximate=self.net[0].approximate))


class WanImageEmbedder(nn.Module):
    """CLIP features -> model width: fp32 LayerNorm, GELU FFN, fp32 LayerNorm (+ FLF2V position table)."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(image_dim)
        self.ff = _FeedForward(image_dim, image_dim, dim, approximate="none")
        self.norm2 = nn.LayerNorm(dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_embed_seq_len, image_dim)) if pos_embed_seq_len else None

    def forward(self, image_states: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            # FLF2V: first and last frame features are stacked along the token axis.
            batch, seq_len, width = image_states.shape
            image_states = image_states.view(-1, 2 * seq_len, width) + self.pos_embed
        dtype = image_states.dtype
        hidden = self.ff(_fp32_layer_norm(self.norm1, image_states).to(dtype))
        return _fp32_layer_norm(self.norm2, hidden).to(hidden.dtype)


class WanConditionEmbedder(nn.Module):
    """Timestep -> (temb, 6-way modulation), text projection and the optional image embedder."""

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        self.freq_dim = config.freq_dim
        self.time_embedder = _TwoLayerMLP(config.freq_dim, dim, nn.SiLU())
        self.act_fn = nn.SiLU()
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = _TwoLayerMLP(config.text_dim, dim, nn.GELU(approximate="tanh"))
        self.image_embedder = (
            WanImageEmbedder(config.image_dim, dim, config.pos_embed_seq_len) if config.image_dim is not None else None
        )

    def embed_timestep(self, timestep: torch.Tensor, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep (B, S) -> temb (B, S, dim) and timestep_proj (B, S, 6, dim)."""
        batch, seq = timestep.shape
        sinusoid = timestep_sinusoid(timestep.flatten(), self.freq_dim).unflatten(0, (batch, seq))
        temb = self.time_embedder(sinusoid.to(self.time_embedder.linear_1.weight.dtype)).to(compute_dtype)
        timestep_proj = self.time_proj(self.act_fn(temb)).unflatten(-1, (6, -1))
        return temb, timestep_proj


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, -1))


def _attend(attention_fn: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, L, H, D) inputs -> attention_fn on (B, H, L, D) -> (B, L, H, D)."""
    return attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class WanAttention(nn.Module):
    """Self- or cross-attention with RMSNorm across heads on q/k and optional added image K/V."""

    def __init__(
        self, dim: int, heads: int, head_dim: int, eps: float, added_kv_proj_dim: int | None = None,
        gate_compress: bool = False,
    ) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_gate_compress: nn.Linear | None = nn.Linear(dim, inner) if gate_compress else None
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.norm_q = nn.RMSNorm(inner, eps=eps)
        self.norm_k = nn.RMSNorm(inner, eps=eps)
        if added_kv_proj_dim is not None:
            self.add_k_proj: nn.Linear | None = nn.Linear(added_kv_proj_dim, inner)
            self.add_v_proj: nn.Linear | None = nn.Linear(added_kv_proj_dim, inner)
            self.norm_added_k: nn.RMSNorm | None = nn.RMSNorm(inner, eps=eps)
        else:
            self.add_k_proj = self.add_v_proj = self.norm_added_k = None

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return _split_heads(self.norm_q(self.to_q(x)), self.heads)

    def _key_value(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _split_heads(self.norm_k(self.to_k(context)), self.heads), _split_heads(self.to_v(context), self.heads)

    def _normed_heads(
        self, norm: nn.RMSNorm, projected: torch.Tensor, ops: FusedOps, rotary: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        eps = norm.eps if norm.eps is not None else torch.finfo(projected.dtype).eps
        return ops.qk_rms_norm_rope(projected, norm.weight, eps, self.heads, rotary)

    def self_attention_fused(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], attention_fn: AttentionFn, ops: FusedOps,
        video: tuple[VideoAttentionFn, tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        """:meth:`self_attention` with RMSNorm + RoPE of q and k done by ``ops`` in one pass each."""
        query = self._normed_heads(self.norm_q, self.to_q(x), ops, rotary)
        key = self._normed_heads(self.norm_k, self.to_k(x), ops, rotary)
        value = _split_heads(self.to_v(x), self.heads)
        return self._project_out(self._self_attend(x, query, key, value, attention_fn, video), query)

    def _self_attend(
        self, x: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_fn: AttentionFn,
        video: tuple[VideoAttentionFn, tuple[int, int, int]] | None,
    ) -> torch.Tensor:
        """(B, L, H, D) attention: the video driver with this layer's gate when one is set, else
        ``attention_fn`` (a gate the checkpoint holds is then unused: only under a recipe override)."""
        if video is None:
            return _attend(attention_fn, query, key, value)
        if self.to_gate_compress is None:
            raise WanConfigError(
                "a video sparse attention driver needs the compression gate (config has_gate_compress: true); "
                "this transformer has none"
            )
        video_fn, grid = video
        gate = _split_heads(self.to_gate_compress(x), self.heads)
        attended = video_fn(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), grid=grid, gate=gate.transpose(1, 2)
        )
        return attended.transpose(1, 2)

    def cross_attention_fused(
        self, x: torch.Tensor, context: torch.Tensor, context_image: torch.Tensor | None, attention_fn: AttentionFn,
        ops: FusedOps,
    ) -> torch.Tensor:
        """:meth:`cross_attention` with the (long) query's RMSNorm done by ``ops``; text K/V stay eager."""
        query = self._normed_heads(self.norm_q, self.to_q(x), ops, None)
        key, value = self._key_value(context)
        attended = _attend(attention_fn, query, key, value)
        if context_image is not None and self.add_k_proj is not None:
            key_image = _split_heads(self.norm_added_k(self.add_k_proj(context_image)), self.heads)
            value_image = _split_heads(self.add_v_proj(context_image), self.heads)
            attended = attended + _attend(attention_fn, query, key_image, value_image).type_as(attended)
        return self._project_out(attended, query)

    def _project_out(self, attended: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self.to_out[0](attended.flatten(2).type_as(like))

    def self_attention(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], attention_fn: AttentionFn,
        video: tuple[VideoAttentionFn, tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        """``video`` = (driver fn, token grid): self-attention through a video sparse attention driver."""
        query = self._query(x)
        key, value = self._key_value(x)
        cos, sin = rotary
        query = apply_rotary(query, cos, sin)
        key = apply_rotary(key, cos, sin)
        return self._project_out(self._self_attend(x, query, key, value, attention_fn, video), query)

    def cross_attention(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        context_image: torch.Tensor | None,
        attention_fn: AttentionFn,
    ) -> torch.Tensor:
        query = self._query(x)
        key, value = self._key_value(context)
        attended = _attend(attention_fn, query, key, value)
        if context_image is not None and self.add_k_proj is not None:
            key_image = _split_heads(self.norm_added_k(self.add_k_proj(context_image)), self.heads)
            value_image = _split_heads(self.add_v_proj(context_image), self.heads)
            attended = attended + _attend(attention_fn, query, key_image, value_image).type_as(attended)
        return self._project_out(attended, query)


@dataclass(frozen=True)
class WanBlockInputs:
    """Everything a block needs besides the token stream; built once per forward by ``prepare``.

    Shapes: ``x`` the initial tokens (B, L, dim) from the patch embedding; ``context`` (B, L_text, dim);
    ``context_image`` (B, L_img, dim) or None;
    ``timestep_proj`` (B, S, 6, dim) and ``temb`` (B, S, dim) with S = 1 for one timestep per
    sample or S = number of tokens for per-token timesteps (Wan 2.2 TI2V); ``rotary`` = (cos, sin),
    each (L, 1, head_dim // 2) fp32; ``grid_sizes`` = post-patch (frames, height, width).
    """

    x: torch.Tensor
    context: torch.Tensor
    context_image: torch.Tensor | None
    timestep_proj: torch.Tensor
    temb: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]
    grid_sizes: tuple[int, int, int]
    #: The model's video self-attention driver (``set_video_attention``); None: ``attention_fn``.
    video_attention: VideoAttentionFn | None = None

    def video(self, self_attention_fn: AttentionFn | None) -> tuple[VideoAttentionFn, tuple[int, int, int]] | None:
        """(driver, grid) for the self-attention, or None. A caller-supplied self-attention (sequence
        parallel's all-to-all) cannot be combined with it: VSA over a sequence shard is not built."""
        if self.video_attention is None:
            return None
        if self_attention_fn is not None:
            raise WanConfigError("video sparse attention with a custom self-attention (sequence parallel) is not supported")
        return self.video_attention, self.grid_sizes


class WanTransformerBlock(nn.Module):
    """adaLN-modulated self-attention (RoPE) -> cross-attention -> GELU(tanh) FFN, fp32 residual math."""

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        dim, heads, eps = config.inner_dim, config.num_attention_heads, config.eps
        self.norm1 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanAttention(dim, heads, config.attention_head_dim, eps, gate_compress=config.has_gate_compress)
        self.attn2 = WanAttention(dim, heads, config.attention_head_dim, eps, config.added_kv_proj_dim)
        self.norm2: nn.Module = (
            nn.LayerNorm(dim, eps, elementwise_affine=True) if config.cross_attn_norm else nn.Identity()
        )
        self.ffn = _FeedForward(dim, config.ffn_dim, dim, approximate="tanh")
        self.norm3 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(_scaled_randn(1, 6, dim))

    def forward(
        self, x: torch.Tensor, inputs: WanBlockInputs, attention_fn: AttentionFn, fused_ops: FusedOps = None,
        self_attention_fn: AttentionFn | None = None,
    ) -> torch.Tensor:
        """``self_attention_fn`` (default ``attention_fn``) runs only the self-attention: sequence
        parallel passes its all-to-all attention here while cross-attention stays local."""
        if fused_ops is not None:
            return self._forward_fused(x, inputs, attention_fn, fused_ops, self_attention_fn)
        video = inputs.video(self_attention_fn)
        self_attention_fn = self_attention_fn or attention_fn
        # (1, 6, dim) + (B, S, 6, dim) -> six (B, S, dim) modulation tensors, in fp32.
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = (
            self.scale_shift_table + inputs.timestep_proj.float()
        ).unbind(2)

        normed = (_fp32_layer_norm(self.norm1, x) * (1 + scale_sa) + shift_sa).type_as(x)
        x = (x.float() + self.attn1.self_attention(normed, inputs.rotary, self_attention_fn, video) * gate_sa).type_as(x)

        if isinstance(self.norm2, nn.LayerNorm):
            normed = _fp32_layer_norm(self.norm2, x).type_as(x)
        else:
            normed = x
        x = x + self.attn2.cross_attention(normed, inputs.context, inputs.context_image, attention_fn)

        normed = (_fp32_layer_norm(self.norm3, x) * (1 + scale_ff) + shift_ff).type_as(x)
        return (x.float() + self.ffn(normed).float() * gate_ff).type_as(x)

    def _forward_fused(
        self, x: torch.Tensor, inputs: WanBlockInputs, attention_fn: AttentionFn, ops: FusedOps,
        self_attention_fn: AttentionFn | None = None,
    ) -> torch.Tensor:
        """The same block with its elementwise glue in fused passes (equal to eager within bf16 rounding)."""
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = (
            self.scale_shift_table + inputs.timestep_proj.float()
        ).unbind(2)
        video = inputs.video(self_attention_fn)
        normed = self.fused_norm1(ops, x, scale_sa, shift_sa, gate_read=video is not None)
        attended = self.attn1.self_attention_fused(normed, inputs.rotary, self_attention_fn or attention_fn, ops, video)
        x, normed = self.fused_norm2(ops, x, attended, gate_sa)
        crossed = self.attn2.cross_attention_fused(normed, inputs.context, inputs.context_image, attention_fn, ops)
        x, normed = self.fused_norm3(ops, x, crossed, scale_ff, shift_ff)
        return ops.gated_residual(x, self.ffn.forward_fused(normed, ops), gate_ff)

    # The fused block's norms. Each writes its output as e4m3 rows (``ops.*_fp8``) when every linear that
    # reads it is an fp8_dynamic one, which would quantize it anyway (docs/precision.md); the causal block
    # shares them.

    def fused_norm1(self, ops: FusedOps, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                    gate_read: bool = False) -> Any:
        """norm1, modulated; ``gate_read``: the video attention's compression gate reads it too."""
        readers = (self.attn1.to_q, self.attn1.to_k, self.attn1.to_v, *((self.attn1.to_gate_compress,) if gate_read else ()))
        if ops.takes_quantized_rows(*readers):
            return ops.modulated_layer_norm_fp8(x, scale, shift, self.norm1.eps)
        return ops.modulated_layer_norm(x, scale, shift, self.norm1.eps)

    def fused_norm2(self, ops: FusedOps, x: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The self-attention's gated residual, then norm2 (affine) when the block has one."""
        if not isinstance(self.norm2, nn.LayerNorm):
            x = ops.gated_residual(x, attended, gate)
            return x, x
        norm = ops.residual_layer_norm_fp8 if ops.takes_quantized_rows(self.attn2.to_q) else ops.residual_layer_norm
        return norm(x, attended, gate, self.norm2.eps, weight=self.norm2.weight, bias=self.norm2.bias)

    def fused_norm3(self, ops: FusedOps, x: torch.Tensor, crossed: torch.Tensor, scale: torch.Tensor,
                    shift: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The cross-attention's residual, then norm3, modulated."""
        norm = ops.residual_layer_norm_fp8 if ops.takes_quantized_rows(self.ffn.net[0].proj) else ops.residual_layer_norm
        return norm(x, crossed, None, self.norm3.eps, scale=scale, shift=shift)


class WanTransformer(nn.Module):
    """The Wan DiT. State-dict keys are those of diffusers' ``WanTransformer3DModel``."""

    def __init__(
        self, config: WanTransformerConfig, attention_fn: AttentionFn | None = None, fused_ops: FusedOps = None
    ) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.rope = WanRotaryEmbedding(config.attention_head_dim, config.rope_max_seq_len)
        patch = config.patch_size
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=patch, stride=patch)
        self.condition_embedder = WanConditionEmbedder(config)
        self.blocks = nn.ModuleList([WanTransformerBlock(config) for _ in range(config.num_layers)])
        self.norm_out = nn.LayerNorm(dim, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(_scaled_randn(1, 2, dim))
        self._attention_fn: AttentionFn = attention_fn or F.scaled_dot_product_attention
        self._video_attention: VideoAttentionFn | None = None
        self._fused_ops: FusedOps = fused_ops

    # -- attention backend

    @property
    def attention_fn(self) -> AttentionFn:
        return self._attention_fn

    def set_attention_fn(self, attention_fn: AttentionFn) -> None:
        """Swap the attention backend: ``attention_fn(q, k, v) -> out``, all (B, heads, L, head_dim)."""
        if not callable(attention_fn):
            raise TypeError(f"attention_fn must be callable, got {type(attention_fn).__name__}")
        self._attention_fn = attention_fn

    @property
    def video_attention(self) -> VideoAttentionFn | None:
        return self._video_attention

    def set_video_attention(self, video_attention: VideoAttentionFn | None) -> None:
        """Route self-attention through a video sparse attention driver's ``attend_video`` (with the
        layers' ``to_gate_compress``); cross-attention keeps ``attention_fn``. None: back to ``attention_fn``."""
        if video_attention is not None and not self.config.has_gate_compress:
            raise WanConfigError(
                "video sparse attention needs the compression gate weights (has_gate_compress: true); "
                "this transformer has none"
            )
        self._video_attention = video_attention

    @property
    def fused_ops(self) -> FusedOps:
        return self._fused_ops

    def set_fused_ops(self, fused_ops: FusedOps) -> None:
        """Use fused elementwise kernels (a ``FusedOps``) in the blocks and the output norm; None: eager."""
        self._fused_ops = fused_ops

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    # -- split forward

    def prepare(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
    ) -> WanBlockInputs:
        """Patchify the latents and embed the conditions; the block loop starts from ``inputs.x``."""
        config = self.config
        if hidden_states.ndim != 5 or hidden_states.shape[1] != config.in_channels:
            raise ValueError(
                f"hidden_states must be (B, {config.in_channels}, F, H, W), got {tuple(hidden_states.shape)}"
            )
        batch, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = config.patch_size
        if frames % p_t or height % p_h or width % p_w:
            raise ValueError(
                f"latent size (F={frames}, H={height}, W={width}) must be divisible by patch_size {config.patch_size}"
            )
        grid_sizes = (frames // p_t, height // p_h, width // p_w)
        num_tokens = math.prod(grid_sizes)
        compute_dtype = self.patch_embedding.weight.dtype

        tokens = self.patch_embedding(hidden_states.to(compute_dtype)).flatten(2).transpose(1, 2).contiguous()
        timestep = self._timestep_grid(timestep, batch, num_tokens)

        embedder = self.condition_embedder
        context = embedder.text_embedder(encoder_hidden_states.to(compute_dtype))
        temb, timestep_proj = embedder.embed_timestep(timestep.to(tokens.device), context.dtype)

        if encoder_hidden_states_image is not None:
            if embedder.image_embedder is None:
                raise ValueError(
                    "encoder_hidden_states_image was given but this model has no image embedder "
                    "(config.image_dim is None)"
                )
            image_tokens = embedder.image_embedder(encoder_hidden_states_image.to(compute_dtype))
            context = torch.cat([image_tokens, context], dim=1)
        context_image = None
        if config.added_kv_proj_dim is not None:
            # diffusers' rule: the added K/V branch reads the first L - 512 context tokens.
            num_image_tokens = context.shape[1] - TEXT_CONTEXT_LENGTH
            if encoder_hidden_states_image is not None and encoder_hidden_states.shape[1] != TEXT_CONTEXT_LENGTH:
                raise ValueError(
                    f"image-conditioned Wan needs exactly {TEXT_CONTEXT_LENGTH} text tokens in encoder_hidden_states, "
                    f"got {encoder_hidden_states.shape[1]}"
                )
            if num_image_tokens > 0:
                context_image, context = context[:, :num_image_tokens], context[:, num_image_tokens:]

        return WanBlockInputs(
            x=tokens,
            context=context,
            context_image=context_image,
            timestep_proj=timestep_proj,
            temb=temb,
            rotary=self.rope(grid_sizes),
            grid_sizes=grid_sizes,
            video_attention=self._video_attention,
        )

    def run_block(self, index: int, x: torch.Tensor, inputs: WanBlockInputs) -> torch.Tensor:
        if self._fused_ops is None:
            return self.blocks[index](x, inputs, self._attention_fn)
        return self.blocks[index](x, inputs, self._attention_fn, self._fused_ops)

    def finish(self, x: torch.Tensor, inputs: WanBlockInputs) -> torch.Tensor:
        """Output norm (modulated by temb), projection and unpatchify -> (B, C_out, F, H, W)."""
        # (1, 1, 2, dim) + (B, S, 1, dim): the head is modulated by temb, not timestep_proj.
        shift, scale = (self.scale_shift_table.unsqueeze(0) + inputs.temb.unsqueeze(2)).unbind(2)
        if self._fused_ops is not None:
            x = self._fused_ops.modulated_layer_norm(x, scale.float(), shift.float(), self.norm_out.eps)
        else:
            x = (_fp32_layer_norm(self.norm_out, x) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)
        batch = x.shape[0]
        frames, height, width = inputs.grid_sizes
        p_t, p_h, p_w = self.config.patch_size
        x = x.reshape(batch, frames, height, width, p_t, p_h, p_w, -1)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(batch, -1, frames * p_t, height * p_h, width * p_w)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        *,
        block_runner: BlockRunner | None = None,
    ) -> torch.Tensor:
        """Denoiser prediction (B, C_out, F, H, W).

        ``timestep``: scalar, (B,) or per-token (B, num_patch_tokens). ``block_runner(model, x, inputs)``,
        when given, replaces the default ``for i: x = model.run_block(i, x, inputs)`` loop.
        """
        inputs = self.prepare(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
        x = inputs.x
        if block_runner is not None:
            x = block_runner(self, x, inputs)
        else:
            for index in range(len(self.blocks)):
                x = self.run_block(index, x, inputs)
        return self.finish(x, inputs)

    @staticmethod
    def _timestep_grid(timestep: torch.Tensor, batch: int, num_tokens: int) -> torch.Tensor:
        """Normalise a timestep to (B, S): S = 1 (per sample) or num_tokens (per token)."""
        timestep = torch.as_tensor(timestep)
        if timestep.ndim == 0:
            return timestep.reshape(1, 1).expand(batch, 1)
        if timestep.ndim == 1:
            if timestep.shape[0] not in (1, batch):
                raise ValueError(f"timestep of shape {tuple(timestep.shape)} does not match batch size {batch}")
            return timestep.reshape(-1, 1).expand(batch, 1)
        if timestep.ndim == 2 and timestep.shape == (batch, num_tokens):
            return timestep
        raise ValueError(
            f"timestep must be a scalar, (B,) or per-token (B, {num_tokens}); got {tuple(timestep.shape)}"
        )

    # -- loading

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: str | Path,
        *,
        subfolder: str | None = "transformer",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        local_files_only: bool = True,
        attention_fn: AttentionFn | None = None,
    ) -> WanTransformer:
        """Load a diffusers-layout checkpoint (``config.json`` + ``*.safetensors``) with no key map."""
        from safetensors.torch import load_file

        directory = _resolve_checkpoint_dir(path_or_repo, subfolder, local_files_only)
        config = WanTransformerConfig.from_diffusers_config(json.loads((directory / "config.json").read_text()))
        shards = sorted(directory.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"no *.safetensors weights in {directory}")
        state_dict: dict[str, torch.Tensor] = {}
        for shard in shards:
            state_dict.update(load_file(shard, device=str(device)))
        with torch.device("meta"):
            model = cls(config, attention_fn=attention_fn)
        load_wan_state_dict(model, state_dict, assign=True)
        model.rope.build_tables(device)
        return cast_for_inference(model, dtype).eval()


def _resolve_checkpoint_dir(path_or_repo: str | Path, subfolder: str | None, local_files_only: bool) -> Path:
    path = Path(path_or_repo)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        patterns = [f"{subfolder}/*"] if subfolder else None
        path = Path(snapshot_download(str(path_or_repo), allow_patterns=patterns, local_files_only=local_files_only))
    return path / subfolder if subfolder else path


def load_wan_state_dict(model: WanTransformer, state_dict: Mapping[str, torch.Tensor], *, assign: bool = False) -> None:
    """Strict load of a diffusers-layout state dict (dropping the unused ``norm_added_q`` keys diffusers ignores)."""
    filtered = {key: value for key, value in state_dict.items() if not IGNORED_CHECKPOINT_KEY_PATTERN.search(key)}
    result = model.load_state_dict(filtered, strict=False, assign=assign)
    if result.missing_keys or result.unexpected_keys:
        raise WanStateDictError(
            f"state dict does not match WanTransformer: missing {sorted(result.missing_keys)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )


def cast_for_inference(
    module: nn.Module, dtype: torch.dtype, keep_in_fp32: tuple[str, ...] = KEEP_IN_FP32_MODULES
) -> nn.Module:
    """Cast floating parameters/buffers to ``dtype`` in place, keeping ``keep_in_fp32`` modules in fp32.

    A tensor is kept when any dot-separated component of its name is in ``keep_in_fp32``
    (diffusers' matching rule), e.g. ``blocks.3.norm2.weight`` or ``condition_embedder.time_embedder.*``.
    """
    # An fp8 linear's (a ``weight_scale`` buffer beside its weight) e4m3 weight and fp32 scale are
    # its precision path's data, not the card's dtype.
    fp8_data = {f"{path}.{leaf}".lstrip(".") for path, sub in module.named_modules()
                if isinstance(getattr(sub, "weight_scale", None), torch.Tensor) for leaf in ("weight", "weight_scale")}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if not tensor.is_floating_point() or name in fp8_data:
            continue
        target = torch.float32 if set(name.split(".")) & set(keep_in_fp32) else dtype
        if tensor.dtype != target:
            tensor.data = tensor.data.to(target)
    return module


# --------------------------------------------------------------------------- original Wan layout

#: Declared rename rules from the original Wan release (``Wan-AI/Wan2.x`` ``*.pth``/safetensors,
#: ``wan/modules/model.py``) to the diffusers layout. Each key must fully match exactly one
#: rule; the first match wins. The original calls the cross-attention norm ``norm3`` and the
#: FFN norm ``norm2`` (which has no weights), diffusers calls them ``norm2`` / ``norm3``.
ORIGINAL_TO_DIFFUSERS_KEYMAP: tuple[tuple[str, str], ...] = (
    (r"patch_embedding\.(weight|bias)", r"patch_embedding.\1"),
    (r"text_embedding\.0\.(weight|bias)", r"condition_embedder.text_embedder.linear_1.\1"),
    (r"text_embedding\.2\.(weight|bias)", r"condition_embedder.text_embedder.linear_2.\1"),
    (r"time_embedding\.0\.(weight|bias)", r"condition_embedder.time_embedder.linear_1.\1"),
    (r"time_embedding\.2\.(weight|bias)", r"condition_embedder.time_embedder.linear_2.\1"),
    (r"time_projection\.1\.(weight|bias)", r"condition_embedder.time_proj.\1"),
    (r"img_emb\.proj\.0\.(weight|bias)", r"condition_embedder.image_embedder.norm1.\1"),
    (r"img_emb\.proj\.1\.(weight|bias)", r"condition_embedder.image_embedder.ff.net.0.proj.\1"),
    (r"img_emb\.proj\.3\.(weight|bias)", r"condition_embedder.image_embedder.ff.net.2.\1"),
    (r"img_emb\.proj\.4\.(weight|bias)", r"condition_embedder.image_embedder.norm2.\1"),
    (r"img_emb\.emb_pos", r"condition_embedder.image_embedder.pos_embed"),
    (r"blocks\.(\d+)\.self_attn\.([qkv])\.(weight|bias)", r"blocks.\1.attn1.to_\2.\3"),
    (r"blocks\.(\d+)\.self_attn\.o\.(weight|bias)", r"blocks.\1.attn1.to_out.0.\2"),
    (r"blocks\.(\d+)\.self_attn\.norm_([qk])\.weight", r"blocks.\1.attn1.norm_\2.weight"),
    (r"blocks\.(\d+)\.cross_attn\.([qkv])\.(weight|bias)", r"blocks.\1.attn2.to_\2.\3"),
    (r"blocks\.(\d+)\.cross_attn\.o\.(weight|bias)", r"blocks.\1.attn2.to_out.0.\2"),
    (r"blocks\.(\d+)\.cross_attn\.norm_([qk])\.weight", r"blocks.\1.attn2.norm_\2.weight"),
    (r"blocks\.(\d+)\.cross_attn\.([kv])_img\.(weight|bias)", r"blocks.\1.attn2.add_\2_proj.\3"),
    (r"blocks\.(\d+)\.cross_attn\.norm_k_img\.weight", r"blocks.\1.attn2.norm_added_k.weight"),
    (r"blocks\.(\d+)\.norm3\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"blocks\.(\d+)\.ffn\.0\.(weight|bias)", r"blocks.\1.ffn.net.0.proj.\2"),
    (r"blocks\.(\d+)\.ffn\.2\.(weight|bias)", r"blocks.\1.ffn.net.2.\2"),
    (r"blocks\.(\d+)\.modulation", r"blocks.\1.scale_shift_table"),
    (r"head\.head\.(weight|bias)", r"proj_out.\1"),
    (r"head\.modulation", r"scale_shift_table"),
)

#: Wrapper prefixes some redistributions (e.g. ComfyUI single-file) put before the original keys.
ORIGINAL_KEY_PREFIXES: tuple[str, ...] = ("model.diffusion_model.", "diffusion_model.")


def _compiled_keymap(underscores: bool) -> tuple[tuple[re.Pattern[str], str], ...]:
    rules = []
    for pattern, replacement in ORIGINAL_TO_DIFFUSERS_KEYMAP:
        # kohya/Musubi names join the path with "_": the same rules, a separator of either kind.
        rules.append((re.compile(pattern.replace(r"\.", r"[._]") if underscores else pattern), replacement))
    return tuple(rules)


_KEYMAP_RULES = {False: _compiled_keymap(False), True: _compiled_keymap(True)}


def original_key_to_diffusers(key: str, *, underscores: bool = False) -> str | None:
    """One original-layout parameter name (prefix already stripped) in the diffusers layout, or None.

    ``underscores``: the path may use ``_`` where the original has ``.`` (kohya/Musubi LoRA names:
    ``blocks_0_self_attn_q.weight`` -> ``blocks.0.attn1.to_q.weight``).
    """
    for pattern, replacement in _KEYMAP_RULES[underscores]:
        match = pattern.fullmatch(key)
        if match:
            return match.expand(replacement)
    return None


def original_rename_map(keys: Iterable[str]) -> dict[str, str]:
    """Each original-Wan-layout key (wrapper prefix allowed) mapped to its diffusers name; raise
    listing any unmapped keys, or naming two keys that map to one name."""
    renames: dict[str, str] = {}
    taken: dict[str, str] = {}
    unmapped: list[str] = []
    for key in keys:
        stripped = next((key[len(p) :] for p in ORIGINAL_KEY_PREFIXES if key.startswith(p)), key)
        new_key = original_key_to_diffusers(stripped)
        if new_key is None:
            unmapped.append(key)
            continue
        if new_key in taken:
            raise WanStateDictError(f"two original keys map to {new_key!r} (second: {key!r})")
        renames[key] = taken[new_key] = new_key
    if unmapped:
        raise WanStateDictError(f"{len(unmapped)} original Wan keys match no rename rule: {sorted(unmapped)}")
    return renames


def convert_original_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an original-Wan-layout state dict to the diffusers layout; raise listing any unmapped keys."""
    renames = original_rename_map(state_dict)
    return {renames[key]: value for key, value in state_dict.items()}


# --------------------------------------------------------------------------- cost model


def count_forward_flops(
    config: WanTransformerConfig,
    num_tokens: int,
    text_tokens: int = TEXT_CONTEXT_LENGTH,
    *,
    image_tokens: int = 0,
    batch_size: int = 1,
    per_token_timesteps: bool = False,
) -> int:
    """Matmul + attention FLOPs (2 per multiply-add) of one forward; norms/elementwise ops are ignored.

    ``num_tokens`` is the post-patch video token count, ``text_tokens`` the text context length,
    ``image_tokens`` the CLIP token count for I2V models (0 otherwise); ``per_token_timesteps`` for
    Wan 2.2 TI2V, where the timestep MLPs run once per token instead of once per sample.
    """
    dim, ffn = config.inner_dim, config.ffn_dim
    n, t = num_tokens, text_tokens
    per_block = (
        2 * n * dim * 3 * dim + 2 * n * dim * dim  # self-attn q/k/v + out projections
        + 4 * n * n * dim  # self-attn QK^T and PV
        + 2 * n * dim * dim + 2 * t * dim * 2 * dim + 2 * n * dim * dim  # cross-attn q, k/v (text), out
        + 4 * n * t * dim  # cross-attn scores and values
        + 2 * n * dim * ffn * 2  # FFN up + down
    )  # fmt: skip
    if config.added_kv_proj_dim is not None and image_tokens:
        per_block += 2 * image_tokens * config.added_kv_proj_dim * 2 * dim + 4 * n * image_tokens * dim
    patch = math.prod(config.patch_size)
    embed = (
        2 * n * config.in_channels * patch * dim  # patch embedding
        + 2 * t * (config.text_dim * dim + dim * dim)  # text projection
        + 2 * n * dim * config.out_channels * patch  # output projection
    )
    timestep_rows = n if per_token_timesteps else 1
    embed += 2 * timestep_rows * (config.freq_dim * dim + dim * dim + dim * 6 * dim)  # time MLP + time_proj
    if config.image_dim is not None and image_tokens:
        embed += 2 * image_tokens * (config.image_dim * config.image_dim + config.image_dim * dim)
    return batch_size * (config.num_layers * per_block + embed)
