"""Building blocks of the Cosmos 3 MoT: norms, MLPs, mRoPE, timestep embedding, attention."""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F


class AttentionFn(Protocol):
    """Swappable attention kernel.

    q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D) with H a multiple of Hkv (GQA).
    ``attn_mask`` is a boolean (Lq, Lk) or (B, 1, Lq, Lk) "may attend" mask, or None.
    Returns (B, H, Lq, D).
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_causal: bool,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor: ...


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Default attention: torch SDPA with native GQA."""
    if is_causal and attn_mask is not None:
        raise ValueError("pass either is_causal=True or an explicit attn_mask, not both")
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
    )


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32.

    ``multiply_in_fp32`` picks where the weight is applied: Nemotron (Edge) multiplies
    in fp32 then casts; the Qwen3 / diffusers RMSNorm casts first, then multiplies.
    The two agree exactly in fp32 and differ only in low-precision rounding.
    """

    def __init__(self, dim: int, eps: float, *, multiply_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.multiply_in_fp32 = multiply_in_fp32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.multiply_in_fp32:
            return (self.weight.float() * x32).to(input_dtype)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            return x32.to(self.weight.dtype) * self.weight
        return (x32 * self.weight).to(input_dtype)


class GatedMLP(nn.Module):
    """SwiGLU (``silu``) or Nemotron squared-ReLU (``relu2``, no gate) feed-forward."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in ("silu", "relu2"):
            raise ValueError(f"hidden_act must be one of ['relu2', 'silu'], got {hidden_act!r}")
        self.hidden_act = hidden_act
        if hidden_act == "silu":
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_act == "relu2":
            return self.down_proj(torch.relu(self.up_proj(x)).square())
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DomainAwareLinear(nn.Module):
    """One (in -> out) affine map per embodiment domain, stored as embedding rows.

    Parameter names (``fc``, ``bias``) match the checkpoint layout.
    """

    def __init__(self, input_size: int, output_size: int, num_domains: int) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.num_domains = num_domains
        self.fc = nn.Embedding(num_domains, input_size * output_size)
        self.bias = nn.Embedding(num_domains, output_size)

    def forward(self, x: torch.Tensor, domain_ids: torch.Tensor) -> torch.Tensor:
        """x: (N, input_size); domain_ids: (N,) long -> (N, output_size)."""
        domain_ids = domain_ids.to(device=x.device, dtype=torch.long).reshape(-1)
        if domain_ids.shape[0] != x.shape[0]:
            raise ValueError(f"action_domain: got {domain_ids.shape[0]} ids for {x.shape[0]} action tokens")
        if bool(((domain_ids < 0) | (domain_ids >= self.num_domains)).any()):
            raise ValueError(
                f"action_domain must be in [0, {self.num_domains}), got {sorted(set(domain_ids.tolist()))}"
            )
        weight = self.fc(domain_ids).view(-1, self.input_size, self.output_size)
        return torch.bmm(x.unsqueeze(1), weight).squeeze(1) + self.bias(domain_ids)


class TimestepEmbedder(nn.Module):
    """256-dim [cos, sin] sinusoid of the (scaled) timestep, then Linear-SiLU-Linear.

    Submodule names (``linear_1``, ``linear_2``) match the checkpoint layout.
    """

    sinusoid_dim = 256
    max_period = 10000.0

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(self.sinusoid_dim, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    @classmethod
    def sinusoid(cls, t: torch.Tensor) -> torch.Tensor:
        half = cls.sinusoid_dim // 2
        exponent = -math.log(cls.max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        angles = t.float()[:, None] * torch.exp(exponent)[None, :]
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)

    def forward(self, scaled_t: torch.Tensor) -> torch.Tensor:
        # The embedder may be kept in fp32 while the rest of the model runs in bf16.
        emb = self.sinusoid(scaled_t).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(emb)))


class MRoPE(nn.Module):
    """Interleaved 3D multimodal RoPE (Qwen3-VL style).

    Frequency slot j of head_dim/2 takes its angle from axis H when j % 3 == 1 and
    j < 3 * sections[1], from W when j % 3 == 2 and j < 3 * sections[2], otherwise
    from T. The table is duplicated to head_dim for rotate-half application.
    """

    def __init__(self, head_dim: int, theta: float, sections: tuple[int, int, int]) -> None:
        super().__init__()
        half = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        axis = torch.zeros(half, dtype=torch.long)
        for axis_index, offset in ((1, 1), (2, 2)):
            axis[offset : sections[axis_index] * 3 : 3] = axis_index
        self.register_buffer("axis_of_slot", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (3, ..., N) (t, h, w) -> cos, sin each (..., N, head_dim)."""
        if positions.shape[0] != 3:
            raise ValueError(f"positions must have a leading axis of 3 (t, h, w), got shape {tuple(positions.shape)}")
        # fp32 on purpose: bf16 cannot represent consecutive integer positions past 256.
        angles = positions.float().unsqueeze(-1) * self.inv_freq.float()  # (3, ..., N, half)
        index = self.axis_of_slot.view(1, *([1] * (angles.ndim - 2)), -1).expand(1, *angles.shape[1:])
        angles = torch.gather(angles, 0, index).squeeze(0)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, N, D); cos/sin: (B, N, D)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
