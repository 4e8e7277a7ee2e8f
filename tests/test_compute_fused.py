"""Fused DiT glue ops: the torch reference equals the eager model; Triton kernels equal the reference.

The Triton kernels run on CUDA, or on CPU through Triton's interpreter when the test is
started with ``TRITON_INTERPRET=1`` and Triton installed (the interpreter rounds fp32 -> bf16
toward zero, so interpreter checks use fp32 tensors, which test indexing and math exactly).
"""

from __future__ import annotations

import os

import pytest
import torch

from fv_kernel.compute.fused import (
    FusedOpsUnavailable,
    TorchFusedOps,
    select_fused_ops,
    triton_available,
)

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
KERNEL_DEVICE = "cuda" if CUDA and triton_available() else "cpu" if INTERPRET else None
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA + triton, or TRITON_INTERPRET=1 + triton")

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(device: str, batch: int = 2, seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 16, 3, 8, 6, generator=g).to(device)
    return latents, torch.tensor([999.0, 17.5][:batch], device=device), torch.randn(batch, 10, 32, generator=g).to(device)


def test_selection_is_explicit() -> None:
    assert select_fused_ops("cpu", "off") is None
    assert select_fused_ops("cpu", "auto") is None  # Triton only on CUDA
    assert isinstance(select_fused_ops("cpu", "torch"), TorchFusedOps)
    with pytest.raises(FusedOpsUnavailable, match="CUDA"):
        select_fused_ops("cpu", "triton")
    with pytest.raises(ValueError, match="'off', 'auto', 'torch', 'triton'"):
        select_fused_ops("cpu", "fast")


def _kernel_ops():  # type: ignore[no-untyped-def]
    from fv_kernel.compute.fused import TritonFusedOps

    return TritonFusedOps()


@needs_kernels
@pytest.mark.parametrize("per_token", [False, True])
def test_triton_kernels_match_reference(per_token: bool) -> None:
    device = KERNEL_DEVICE
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    ref, fused = TorchFusedOps(), _kernel_ops()
    g = torch.Generator().manual_seed(5 + per_token)
    batch, tokens, heads, head_dim = 2, 6, 4, 12
    width = heads * head_dim
    x, y = (torch.randn(batch, tokens, width, generator=g).to(device, dtype) for _ in range(2))
    mod = torch.randn(batch, tokens if per_token else 1, 6, width, generator=g).to(device)
    shift, scale, gate = mod.unbind(2)[:3]
    weight, bias = torch.randn(width, generator=g).to(device), torch.randn(width, generator=g).to(device)
    eps = 1e-6

    assert _rel(fused.modulated_layer_norm(x, scale, shift, eps), ref.modulated_layer_norm(x, scale, shift, eps)) < tol
    assert _rel(fused.gated_residual(x, y, gate), ref.gated_residual(x, y, gate)) < tol
    for kwargs, g_ in (({"weight": weight, "bias": bias}, gate), ({"scale": scale, "shift": shift}, None)):
        got = fused.residual_layer_norm(x, y, g_, eps, **kwargs)
        want = ref.residual_layer_norm(x, y, g_, eps, **kwargs)
        assert _rel(got[0], want[0]) < tol and _rel(got[1], want[1]) < tol
    qk_weight = torch.randn(width, generator=g).to(device, dtype)
    cos, sin = (torch.randn(tokens, 1, head_dim // 2, generator=g).to(device) for _ in range(2))
    for rotary in ((cos, sin), None):
        got = fused.qk_rms_norm_rope(x, qk_weight, eps, heads, rotary)
        assert got.shape == (batch, tokens, heads, head_dim)
        assert _rel(got, ref.qk_rms_norm_rope(x, qk_weight, eps, heads, rotary)) < tol
