"""The causal chunk forward with the instance's fused ops (``compute.fused_ops``), as the bidirectional block has them.

The reference fused ops (``TorchFusedOps``) are the eager formulas, so the causal forward through them must be the
eager causal forward bit for bit; the Triton kernels (on CUDA, else in Triton's interpreter in fp32, this file run as
a script with ``TRITON_INTERPRET=1``) must follow it within rounding. Rows of one batched forward start at
different latent frames (their own RoPE tables) and attend to histories of different lengths.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from fv_kernel.compute.fused import TorchFusedOps, TritonFusedOps
from fv_kernel.testing.triton_checks import run_kernel_checks
from fv_wan.models import causal_transformer
from fv_wan.models.causal_transformer import causal_batch_forward, causal_chunk_forward
from fv_wan.models.transformer import WanTransformer

from test_compute_fused_wan import KERNEL_OPS, _model, counting

def _case(model: WanTransformer, device: str, rows: int = 2) -> dict[str, Any]:
    """Rows starting at latent frames 0, 3, ... over histories of 0, 1, ... chunks of random committed K/V."""
    c = model.config
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(3)
    frames, height, width = 3, 8, 6
    tokens = frames * (height // c.patch_size[1]) * (width // c.patch_size[2])
    heads, head_dim = c.num_attention_heads, c.attention_head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    histories = [[(randn(1, r * tokens, heads, head_dim), randn(1, r * tokens, heads, head_dim))
                  for _ in range(c.num_layers)] for r in range(rows)]
    return {"latents": randn(rows, c.in_channels, frames, height, width),
            "timestep": torch.tensor([999.0, 250.0, 17.5][:rows], device=device),
            "context": randn(rows, 10, c.text_dim), "start_frames": [frames * r for r in range(rows)],
            "histories": histories}


def _batched(model: WanTransformer, case: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return causal_batch_forward(model, case["latents"], case["timestep"], case["context"],
                                    start_frames=case["start_frames"], histories=case["histories"])


def _one_stream(model: WanTransformer, case: dict[str, Any], row: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Row ``row`` alone through ``causal_chunk_forward``, with the K it would commit."""
    keys: list[torch.Tensor] = []
    with torch.no_grad():
        out = causal_chunk_forward(model, case["latents"][row : row + 1], case["timestep"][row : row + 1],
                                   case["context"][row : row + 1], start_frame=case["start_frames"][row],
                                   history=case["histories"][row], kv_sink=lambda layer, k, v: keys.append(k))
    return out, keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_fused_causal_forward_is_bitwise_the_eager_one(dtype: torch.dtype) -> None:
    model = _model(dtype)
    case = _case(model, "cpu", rows=3)
    eager = _batched(model, case)
    eager_one, eager_keys = _one_stream(model, case, 1)
    ops = TorchFusedOps()
    calls = counting(ops)
    model.set_fused_ops(ops)
    assert torch.equal(_batched(model, case), eager)
    assert set(calls) == set(KERNEL_OPS), calls
    fused_one, fused_keys = _one_stream(model, case, 1)
    assert torch.equal(fused_one, eager_one)
    assert all(torch.equal(a, b) for a, b in zip(fused_keys, eager_keys))  # the committed K (after RoPE)


def test_each_row_is_rotated_by_its_own_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the fused path rotating every row by row 0's RoPE table no longer equals eager."""
    model = _model(torch.float32)
    case = _case(model, "cpu", rows=2)
    eager = _batched(model, case)
    model.set_fused_ops(TorchFusedOps())
    real = causal_transformer._rows_normed_heads

    def row0_table(attn: Any, norm: Any, projected: torch.Tensor, ops: Any, rotary: Any) -> torch.Tensor:
        cos, sin = rotary
        if cos.dim() == 4:
            rotary = (cos[0], sin[0])
            return torch.cat([attn._normed_heads(norm, projected[r : r + 1], ops, rotary) for r in range(projected.shape[0])])
        return real(attn, norm, projected, ops, rotary)

    monkeypatch.setattr(causal_transformer, "_rows_normed_heads", row0_table)
    assert not torch.allclose(_batched(model, case), eager, atol=1e-3)


def triton_causal_check(device: str) -> dict[str, Any]:
    """The tiny causal forward (3 rows, different starts and histories) with the Triton kernels against eager."""
    ops = TritonFusedOps()
    calls = counting(ops)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = _model(dtype, device)
    case = _case(model, device, rows=3)
    eager = _batched(model, case)
    model.set_fused_ops(ops)
    fused = _batched(model, case)
    rel = ((fused.double() - eager.double()).norm() / eager.double().norm()).item()
    return {"rel": rel, "tol": 2e-2 if dtype == torch.bfloat16 else 1e-5, "calls": dict(calls)}


def test_triton_fused_causal_forward_matches_eager() -> None:
    result = run_kernel_checks(__file__, lambda: triton_causal_check("cuda"), what="the Triton kernels")
    assert result["rel"] < result["tol"], result
    assert set(result["calls"]) == set(KERNEL_OPS), result["calls"]  # the forward really went through each kernel


if __name__ == "__main__":  # the test's fresh-process run (TRITON_INTERPRET=1 set by the caller)
    torch.set_num_threads(1)
    print(json.dumps(triton_causal_check("cpu")))
