"""Kernel compute tiers (fused ops, per-block compile, CUDA graphs) on the Wan DiT: each equals eager."""

from __future__ import annotations

import os

import pytest
import torch

from fv_kernel.compute.fused import TorchFusedOps, TritonFusedOps, triton_available
from fv_wan.models.transformer import WanTransformer, WanTransformerConfig, cast_for_inference

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
KERNEL_DEVICE = "cuda" if CUDA and triton_available() else "cpu" if INTERPRET else None
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA + triton, or TRITON_INTERPRET=1 + triton")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _model(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> WanTransformer:
    torch.manual_seed(seed)
    model = WanTransformer(WanTransformerConfig.tiny()).to(device).eval()
    with torch.no_grad():
        for p in model.parameters():  # no zero-initialised term may hide a wrong path
            p.copy_(torch.randn_like(p) * 0.3)
    return cast_for_inference(model, dtype)


def _inputs(device: str, batch: int = 2, seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 16, 3, 8, 6, generator=g).to(device)
    return latents, torch.tensor([999.0, 17.5][:batch], device=device), torch.randn(batch, 10, 32, generator=g).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_fused_path_is_bitwise_the_eager_model(dtype: torch.dtype) -> None:
    model = _model(dtype)
    inputs = _inputs("cpu")
    with torch.no_grad():
        eager = model(*inputs)
        model.set_fused_ops(TorchFusedOps())
        fused = model(*inputs)
    assert torch.equal(eager, fused)


@needs_kernels
def test_triton_fused_model_matches_eager() -> None:
    device = KERNEL_DEVICE
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = _model(dtype, device)
    inputs = _inputs(device)
    with torch.no_grad():
        eager = model(*inputs)
        model.set_fused_ops(TritonFusedOps())
        fused = model(*inputs)
    assert _rel(fused, eager) < (2e-2 if dtype == torch.bfloat16 else 1e-5)
