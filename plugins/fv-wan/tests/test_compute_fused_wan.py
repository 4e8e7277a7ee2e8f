"""Kernel compute tiers (fused ops, per-block compile, CUDA graphs) on the Wan DiT: each equals eager.

The Triton kernels run on CUDA when there is one, else on CPU in Triton's interpreter: this
file runs as a script in a fresh Python with ``TRITON_INTERPRET=1`` set from the start
(Triton reads it when ``triton.language`` is first imported, which torch and diffusers do as
a side effect); fp32 there, since the interpreter rounds to bf16 toward zero. CI sets
``FV_REQUIRE_TRITON_KERNELS=1`` where triton is installed (tox ``wan-kcur``), so a missing
triton fails there instead of skipping.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import torch

from fv_kernel.compute.fused import TorchFusedOps, TritonFusedOps
from fv_kernel.testing.triton_checks import run_kernel_checks
from fv_wan.models.transformer import WanTransformer, WanTransformerConfig, cast_for_inference

CUDA = torch.cuda.is_available()
KERNEL_OPS = ("modulated_layer_norm", "residual_layer_norm", "gated_residual", "qk_rms_norm_rope")


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


def counting(ops: Any, names: tuple[str, ...] = KERNEL_OPS) -> Counter[str]:
    """Count each op of ``names`` that ``ops`` runs (a comparison means something only if the forward went
    through them)."""
    calls: Counter[str] = Counter()
    for name in names:
        def counted(*args: Any, _run: Any = getattr(ops, name), _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _run(*args, **kwargs)

        setattr(ops, name, counted)
    return calls


def triton_model_check(device: str) -> dict[str, Any]:
    """The tiny Wan DiT with the Triton kernels against eager: relative error, and how often each kernel ran."""
    ops = TritonFusedOps()
    calls = counting(ops)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = _model(dtype, device)
    inputs = _inputs(device)
    with torch.no_grad():
        eager = model(*inputs)
        model.set_fused_ops(ops)
        fused = model(*inputs)
    return {"rel": _rel(fused, eager), "tol": 2e-2 if dtype == torch.bfloat16 else 1e-5, "calls": dict(calls)}


def test_triton_fused_model_matches_eager() -> None:
    result = run_kernel_checks(__file__, lambda: triton_model_check("cuda"), what="the Triton kernels")
    assert result["rel"] < result["tol"], result
    # The comparison means something only if the forward really went through every kernel.
    assert set(result["calls"]) == set(KERNEL_OPS), result["calls"]


if __name__ == "__main__":  # the test's fresh-process run (TRITON_INTERPRET=1 set by the caller)
    torch.set_num_threads(1)
    print(json.dumps(triton_model_check("cpu")))
