"""Attention drivers with the kernel chosen deliberately, and the FlashAttention drivers.

``sdpa`` lets PyTorch pick a kernel per call; the drivers here pin one, so a deploy
config states what runs (on an H200 at 32,760 tokens x 12 heads x 128, one layer's
self-attention measured 11.6 ms with cuDNN, 18.1 ms with flash and 37.1 ms with the
mem-efficient kernel: the choice matters more than any elementwise fusion).

FlashAttention-3 (``flash_attn_interface``, Hopper) and FlashAttention-2 (``flash_attn``)
are imported when the driver is constructed, never at module import, and a missing
package is an :class:`AttentionBackendUnavailable` naming it.

No dense Triton attention kernel is shipped (the ``vsa`` driver's block-sparse one is separate): at this shape cuDNN already reaches about
570 TFLOP/s on an H200 (72% of the measured 800 TFLOP/s matmul rate); published
Triton flash-attention kernels for head_dim 128 on Hopper stay below that without
warp-specialised wgmma/TMA pipelines, so a Triton kernel would not win here.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F

from fv_kernel.compute.attention import AttentionBackend, AttentionShapeError, SDPAAttention

__all__ = [
    "AttentionBackendUnavailable",
    "SDPACudnnAttention",
    "SDPAFlashAttention",
    "SDPAEfficientAttention",
    "SDPAMathAttention",
    "FlashAttention3",
    "FlashAttention2",
    "attention_callable",
    "pinned_sdpa",
]

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_HALF = (torch.float16, torch.bfloat16)


class AttentionBackendUnavailable(RuntimeError):
    """The selected attention backend cannot run here (missing package, device or dtype)."""


@torch.library.custom_op("fv::pinned_sdpa", mutates_args=())
def pinned_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
    scale: float | None, backend: str,
) -> torch.Tensor:
    """SDPA under one pinned kernel (``backend``: an ``SDPBackend`` member name) as one opaque op.

    What a pinned driver runs inside ``torch.compile``: traced as a plain SDPA call, the kernel is
    re-chosen at compile time, not by the ``sdpa_kernel`` context the eager path uses.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return out.contiguous()  # the strides the fake below promises the compiler


@pinned_sdpa.register_fake
def _pinned_sdpa_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
    scale: float | None, backend: str,
) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


class _PinnedSDPA(AttentionBackend):
    """SDPA restricted to one kernel through ``torch.nn.attention.sdpa_kernel``."""

    #: ``torch.nn.attention.SDPBackend`` member name.
    sdpa_backend: ClassVar[str]
    #: ``sdpa_kernel`` disables SDPA's other kernels for the whole process while a call runs.
    sets_process_flags: ClassVar[bool] = True
    needs_cuda: ClassVar[bool] = True
    half_only: ClassVar[bool] = True
    supports_mask: ClassVar[bool] = True

    def __init__(self) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self._backend = getattr(SDPBackend, self.sdpa_backend)
        self._sdpa_kernel = sdpa_kernel

    def supports(self, *, dtype: torch.dtype, device: torch.device, head_dim: int, has_mask: bool) -> bool:
        return self._why_not(dtype=dtype, device=device, has_mask=has_mask) is None

    def _why_not(self, *, dtype: torch.dtype, device: torch.device, has_mask: bool) -> str | None:
        if self.needs_cuda and device.type != "cuda":
            return f"needs a CUDA device, got {device}"
        if self.half_only and dtype not in _HALF:
            return f"needs fp16 or bf16 inputs, got {dtype}"
        if has_mask and not self.supports_mask:
            return "does not take an attention mask"
        return None

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
        reason = self._why_not(dtype=q.dtype, device=q.device, has_mask=attn_mask is not None)
        if reason is not None:
            raise AttentionBackendUnavailable(f"attention backend {self.name!r} {reason}")
        self.check_shapes(q, k, v)
        if attn_mask is not None and is_causal:
            raise AttentionShapeError("pass either attn_mask or is_causal=True, not both")
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if torch.compiler.is_compiling() and not torch.is_grad_enabled():
            # Inference under torch.compile: the pinned kernel as one opaque op (no backward is registered).
            return pinned_sdpa(q, k, v, attn_mask, is_causal, scale, self.sdpa_backend)
        with self._sdpa_kernel(self._backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


class SDPACudnnAttention(_PinnedSDPA):
    """SDPA pinned to cuDNN's fused attention (fastest measured on H200 at Wan video sizes)."""

    name: ClassVar[str] = "sdpa_cudnn"
    sdpa_backend: ClassVar[str] = "CUDNN_ATTENTION"


class SDPAFlashAttention(_PinnedSDPA):
    """SDPA pinned to PyTorch's bundled FlashAttention-2 kernel."""

    name: ClassVar[str] = "sdpa_flash"
    sdpa_backend: ClassVar[str] = "FLASH_ATTENTION"
    supports_mask: ClassVar[bool] = False


class SDPAEfficientAttention(_PinnedSDPA):
    """SDPA pinned to the memory-efficient (xformers-style) kernel; also takes fp32."""

    name: ClassVar[str] = "sdpa_efficient"
    sdpa_backend: ClassVar[str] = "EFFICIENT_ATTENTION"
    half_only: ClassVar[bool] = False


class SDPAMathAttention(_PinnedSDPA):
    """SDPA pinned to the unfused math path: any device and dtype; the slow reference."""

    name: ClassVar[str] = "sdpa_math"
    sdpa_backend: ClassVar[str] = "MATH"
    needs_cuda: ClassVar[bool] = False
    half_only: ClassVar[bool] = False


class _FlashAttentionPackage(AttentionBackend):
    """A FlashAttention package's ``flash_attn_func`` on (B, L, H, D) tensors; no masks."""

    module_name: ClassVar[str]
    package_hint: ClassVar[str]

    def __init__(self) -> None:
        try:
            module = importlib.import_module(self.module_name)
        except Exception as exc:  # ImportError, or a CUDA-library load error inside the extension
            raise AttentionBackendUnavailable(
                f"attention backend {self.name!r} needs the {self.module_name!r} module ({self.package_hint}), "
                f"which cannot be imported: {type(exc).__name__}: {exc}"
            ) from exc
        self._flash_attn_func: Callable[..., Any] = module.flash_attn_func

    def supports(self, *, dtype: torch.dtype, device: torch.device, head_dim: int, has_mask: bool) -> bool:
        return device.type == "cuda" and dtype in _HALF and not has_mask and head_dim <= 256

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
        if not self.supports(dtype=q.dtype, device=q.device, head_dim=q.shape[-1], has_mask=attn_mask is not None):
            raise AttentionBackendUnavailable(
                f"attention backend {self.name!r} needs CUDA fp16/bf16 inputs, head_dim <= 256 and no mask; "
                f"got {q.dtype} on {q.device}, head_dim {q.shape[-1]}, mask={'yes' if attn_mask is not None else 'no'}"
            )
        # (B, H, L, D) -> (B, L, H, D): a transpose back to the model's own layout, usually zero-copy.
        out = self._flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=is_causal
        )
        if isinstance(out, tuple):  # some FA3 releases return (out, softmax_lse)
            out = out[0]
        return out.transpose(1, 2)


class FlashAttention3(_FlashAttentionPackage):
    """FlashAttention-3 (Hopper): ``flash_attn_interface.flash_attn_func``."""

    name: ClassVar[str] = "flash_attn3"
    module_name: ClassVar[str] = "flash_attn_interface"
    package_hint: ClassVar[str] = "FlashAttention-3, built from flash-attention's hopper/ directory"


class FlashAttention2(_FlashAttentionPackage):
    """FlashAttention-2: ``flash_attn.flash_attn_func``."""

    name: ClassVar[str] = "flash_attn2"
    module_name: ClassVar[str] = "flash_attn"
    package_hint: ClassVar[str] = "the flash-attn package"


def attention_callable(backend: AttentionBackend) -> AttentionFn:
    """The ``fn(q, k, v)`` a model's ``set_attention_fn`` takes; the plain ``sdpa`` driver maps to
    ``F.scaled_dot_product_attention`` itself so the default path stays exactly today's call."""
    if type(backend) is SDPAAttention:
        return F.scaled_dot_product_attention
    return backend.attend
