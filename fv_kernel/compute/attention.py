"""The attention-backend driver contract and the built-in ``sdpa`` driver.

Drivers are classes registered under the ``fv.attention_backends`` entry-point group
and selected by name; model code calls :meth:`AttentionBackend.attend` and never
names a kernel library itself.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch
import torch.nn.functional as F


class AttentionShapeError(ValueError):
    """q/k/v (or the mask) do not have compatible attention shapes."""


class AttentionBackend(abc.ABC):
    """Scaled dot-product attention over ``(batch, heads, seq, head_dim)`` tensors.

    Implementations must be numerically equivalent to softmax attention up to their
    declared tolerance and must not keep per-request state (one instance serves
    every request). Grouped-query attention is expressed by ``k``/``v`` having fewer
    heads than ``q``, dividing it.
    """

    #: The driver's registry name (its entry-point name).
    name: ClassVar[str]
    #: Whether self-attention over a video needs the token grid (``attend_video(q, k, v, grid=, gate=)``,
    #: e.g. tiled sparse attention); model code routes its self-attention there when set.
    needs_video_grid: ClassVar[bool] = False
    #: Whether a call changes process-wide torch settings while it runs (``sdpa_kernel``'s backend
    #: flags): another thread's attention reads them meanwhile, so such a driver is refused beside
    #: a second device lane (``scheduler.overlap_kinds``).
    sets_process_flags: ClassVar[bool] = False

    def for_assumption(self, assumption: Any) -> "AttentionBackend":
        """This driver configured with a recipe's ``AttentionAssumption`` (its sparsity, tile...);
        drivers with no settings return themselves."""
        return self

    def supports(self, *, dtype: torch.dtype, device: torch.device, head_dim: int, has_mask: bool) -> bool:
        """Whether this backend can run the given case; callers fall back when not."""
        return True

    @abc.abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Return ``softmax(q kᵀ · scale + mask) v`` with shape ``(batch, heads, q_len, head_dim_v)``.

        ``attn_mask`` is boolean (True = attend) or additive float, broadcastable to
        ``(batch, heads, q_len, kv_len)``. ``scale`` defaults to ``head_dim ** -0.5``.
        """

    @staticmethod
    def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise :class:`AttentionShapeError` unless q/k/v are compatible 4-D tensors."""
        for label, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise AttentionShapeError(f"{label} must be (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if k.shape[:3] != v.shape[:3]:
            raise AttentionShapeError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in batch/heads/seq")
        if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
            raise AttentionShapeError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
        if q.shape[1] % k.shape[1] != 0:
            raise AttentionShapeError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")


class SDPAAttention(AttentionBackend):
    """PyTorch's ``scaled_dot_product_attention`` (picks flash/mem-efficient/math itself)."""

    name: ClassVar[str] = "sdpa"

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        self.check_shapes(q, k, v)
        if attn_mask is not None and is_causal:
            raise AttentionShapeError("pass either attn_mask or is_causal=True, not both")
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            # Explicit repeat keeps the result independent of the torch version's enable_gqa support.
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
