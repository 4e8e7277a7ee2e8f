"""The Triton decode kernels (``fv_cosmos3.decode_kernels``, ``compute.fused_ops: triton``) against the composed step.

On CUDA they run on the GPU in bf16; without one this file runs itself as a script under Triton's interpreter
(``TRITON_INTERPRET=1`` from the start, ``fv_kernel.testing.triton_checks``) in fp32: the interpreter rounds
fp32 -> bf16 toward zero, so fp32 checks the indexing and the math exactly and bf16 is for the GPU. The
references are torch ops written here or the composed step (``static_decode_step`` without kernels), never the
kernels' own code. ``FV_REQUIRE_TRITON_KERNELS=1`` (tox's cosmos3-kcur) fails instead of skipping without triton.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from bench_ar_token import CONFIGS, DecodeBench  # noqa: E402

from fv_cosmos3.decode_kernels import DecodeKernels, DecodeKernelsUnavailable, decode_kernels_available
from fv_cosmos3.graphed_decode import DecodePlan, GraphedDecode, decode_kernels_unsupported, pack_weights
from fv_kernel.testing.triton_checks import run_kernel_checks


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| relative to b's largest magnitude (inf on a shape mismatch or a non-finite value)."""
    if a.shape != b.shape or not torch.isfinite(a).all():
        return float("inf")
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _norm_reference(h: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool) -> torch.Tensor:
    """RMSNorm written out: fp32 statistics, the weight after the rounding (Qwen) or in fp32."""
    h32 = h.float()
    n = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return (n.to(h.dtype) * weight if round_first else (n * weight.float()).to(h.dtype))


def _qk_reference(heads: torch.Tensor, gains: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  q_heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Hq, 1, D), k and v (B, Hkv, D): per-head RMSNorm x gain, then RoPE with rotate_half."""
    qk = heads[:, 0, : q_heads + kv_heads]
    n = (qk.float() * torch.rsqrt(qk.float().pow(2).mean(-1, keepdim=True) + eps)).to(qk.dtype) * gains
    half = n.shape[-1] // 2
    rotated = torch.cat([-n[..., half:], n[..., :half]], dim=-1)
    sin_plain = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # undo the kernel's convention
    out = n * cos[:, None] + rotated * sin_plain[:, None]
    return out[:, :q_heads, None], out[:, q_heads:], heads[:, 0, q_heads + kv_heads :]


def kernel_checks(device: str) -> dict[str, Any]:
    """Each kernel and the whole step against their references: the largest relative error of each."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kernels = DecodeKernels()
    g = torch.Generator().manual_seed(11)
    results: dict[str, Any] = {"dtype": str(dtype)}

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # add + RMSNorm, both conventions, with and without the residual add; a width that is not a power of two.
    for width in (48, 4096):
        hidden, delta, weight = rand(3, 1, width), rand(3, 1, width), 1 + 0.1 * rand(width)
        for round_first in (True, False):
            summed, normed = kernels.add_rms_norm(hidden, delta, weight, 1e-6, round_before_weight=round_first)
            results[f"add_rms_norm/{width}/round_first={round_first}/sum"] = _max_rel(summed, hidden + delta)
            results[f"add_rms_norm/{width}/round_first={round_first}/norm"] = _max_rel(
                normed, _norm_reference(hidden + delta, weight, 1e-6, round_first))
        same, normed = kernels.add_rms_norm(hidden, None, weight, 1e-6, round_before_weight=True)
        results[f"add_rms_norm/{width}/no_delta"] = _max_rel(normed, _norm_reference(hidden, weight, 1e-6, True))
        results[f"add_rms_norm/{width}/no_delta_returns_hidden"] = float(same is hidden)

    # q/k norm + RoPE + K/V writes: rows at different positions, history views strided as the step's.
    batch, q_heads, kv_heads, dim, context = 3, 4, 2, 16, 9
    heads = rand(batch, 1, q_heads + 2 * kv_heads, dim)
    gains = 1 + 0.1 * rand(q_heads + kv_heads, dim)
    angle = torch.rand(batch, dim // 2, generator=g) * 6.28
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1).to(device=device, dtype=dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], dim=-1).to(device=device, dtype=dtype)  # first half negated
    position = torch.tensor([0, 5, 8], device=device)
    pooled = [rand(2, kv_heads, batch, context + 3, dim) for _ in range(2)]  # (layers, Hkv, B, ctx', D)
    history = (pooled[0][1, :, :, :context], pooled[1][1, :, :, :context])
    before = [h.clone() for h in history]
    beside = [p[0].clone() for p in pooled]  # the other layer's history in the same tensors
    rows = (torch.empty(batch, kv_heads, dim, device=device, dtype=dtype),
            torch.empty(batch, kv_heads, dim, device=device, dtype=dtype))
    q = kernels.qk_norm_rope_store(heads, gains, cos, sin, 1e-6, position, history, rows,
                                   q_heads=q_heads, kv_heads=kv_heads)
    q_ref, k_ref, v_ref = _qk_reference(heads, gains, cos, sin, 1e-6, q_heads, kv_heads)
    results["qk/q"] = _max_rel(q, q_ref)
    results["qk/rows_k"] = _max_rel(rows[0], k_ref)
    results["qk/rows_v"] = _max_rel(rows[1], v_ref)
    expected_k, expected_v = (b.clone() for b in before)
    every = torch.arange(batch, device=device)
    expected_k[:, every, position] = k_ref.transpose(0, 1)
    expected_v[:, every, position] = v_ref.transpose(0, 1)
    results["qk/history_k"] = _max_rel(history[0], expected_k)
    results["qk/history_v"] = _max_rel(history[1], expected_v)
    # Only each row's own position is written (the layer beside it in the pooled tensor, too, is untouched).
    results["qk/other_layer_untouched"] = float(all(torch.equal(p[0], b) for p, b in zip(pooled, beside)))
    results["qk/slots_written"] = int((history[0] != before[0]).any(-1).sum())

    gate_up = rand(3, 1, 2 * 40)
    gate, up = gate_up.chunk(2, dim=-1)
    results["silu_mul"] = _max_rel(kernels.silu_mul(gate_up), F.silu(gate) * up)

    # The whole step: graphed decode with the kernels against the composed step, same weights and pool.
    for rows_count in (1, 3):
        composed, fused = (DecodeBench.build(CONFIGS["tiny"], rows_count, history=40, steps=3, seed=4, dtype=dtype,
                                             device=device) for _ in range(2))
        capture = None if device == "cuda" else False  # on CUDA both steps are captured graphs, replayed
        plain = GraphedDecode((4,), capture=capture)
        with_kernels = GraphedDecode((4,), capture=capture, kernels=kernels)
        worst = 0.0
        for _ in range(3):
            expected, actual = _step(composed, plain), _step(fused, with_kernels)
            worst = max(worst, _max_rel(actual, expected))
            same_tokens = torch.equal(actual.argmax(-1), expected.argmax(-1))
        results[f"step/rows={rows_count}/logits"] = worst
        results[f"step/rows={rows_count}/captures"] = with_kernels.captures
        results[f"step/rows={rows_count}/same_tokens"] = float(same_tokens)
        results[f"step/rows={rows_count}/pool"] = max(
            _max_rel(x, y) for x, y in zip(fused.pool.storage(), composed.pool.storage()))
    return results


def _step(bench: DecodeBench, graphed: GraphedDecode) -> torch.Tensor:
    inputs = {"token": bench.token, "table": bench.table_ids, "length": torch.tensor(bench.lengths, dtype=torch.long)}
    with torch.inference_mode():
        out = graphed.run(bench.mot, bench.pool, "v1", inputs)
    assert out is not None
    bench.token = out["logits"].argmax(-1, keepdim=True)
    bench.lengths = [length + 1 for length in bench.lengths]
    return out["logits"]


@pytest.fixture(scope="module")
def checks() -> dict[str, Any]:
    return run_kernel_checks(__file__, lambda: kernel_checks("cuda"), what="fv-cosmos3's decode kernels")


def _tolerance(checks: dict[str, Any]) -> float:
    return 2e-2 if "bfloat16" in checks["dtype"] else 2e-6


@pytest.mark.parametrize("name", [
    "add_rms_norm/48/round_first=True/sum", "add_rms_norm/48/round_first=True/norm",
    "add_rms_norm/48/round_first=False/norm", "add_rms_norm/4096/round_first=True/norm",
    "add_rms_norm/4096/round_first=False/norm", "add_rms_norm/48/no_delta", "add_rms_norm/4096/no_delta",
    "qk/q", "qk/rows_k", "qk/rows_v", "qk/history_k", "qk/history_v", "silu_mul",
])
def test_each_kernel_matches_its_written_out_reference(checks: dict[str, Any], name: str) -> None:
    assert checks[name] <= _tolerance(checks), f"{name}: max relative error {checks[name]:.3g}"


def test_the_qk_kernel_writes_each_rows_own_position_and_nothing_else(checks: dict[str, Any]) -> None:
    assert checks["qk/slots_written"] == 3 * 2  # 3 rows x 2 kv heads, one position each
    assert checks["qk/other_layer_untouched"] == 1.0
    assert checks["add_rms_norm/48/no_delta_returns_hidden"] == 1.0


@pytest.mark.parametrize("rows", [1, 3])
def test_a_step_with_the_kernels_follows_the_composed_step(checks: dict[str, Any], rows: int) -> None:
    """Three greedy steps of the tiny reasoner (GQA 2:1, hidden 48), padded into bucket 4 with 3 rows."""
    assert checks[f"step/rows={rows}/logits"] <= 10 * _tolerance(checks)
    assert checks[f"step/rows={rows}/same_tokens"] == 1.0
    assert checks[f"step/rows={rows}/captures"] >= 1
    assert checks[f"step/rows={rows}/pool"] <= 10 * _tolerance(checks)


# --------------------------------------------------------------------------- negative controls and errors


def test_the_reference_catches_a_rope_with_the_wrong_sign() -> None:
    """The check's own reference is sensitive: RoPE with sin's sign flipped (the bug the kernel's negated-sin
    convention invites) moves q far past the tolerance."""
    g = torch.Generator().manual_seed(0)
    heads = torch.randn(2, 1, 8, 16, generator=g)
    gains = torch.ones(6, 16)
    angle = torch.rand(2, 8, generator=g) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([-angle.sin(), angle.sin()], -1)
    right = _qk_reference(heads, gains, cos, sin, 1e-6, 4, 2)[0]
    wrong = _qk_reference(heads, gains, cos, -sin, 1e-6, 4, 2)[0]
    assert _max_rel(wrong, right) > 0.1


def test_the_kernels_refuse_cpu_tensors_outside_the_interpreter() -> None:
    if not decode_kernels_available():
        pytest.skip("needs triton")
    kernels = DecodeKernels()
    if kernels.interpreted:
        pytest.skip("this process runs Triton's interpreter")
    with pytest.raises(DecodeKernelsUnavailable, match="CUDA"):
        kernels.silu_mul(torch.zeros(1, 1, 8))


def test_a_reasoner_the_kernels_do_not_cover_is_named() -> None:
    bench = DecodeBench.build(CONFIGS["tiny"], 1, history=40, steps=1)
    assert "packed" in str(decode_kernels_unsupported(bench.mot, DecodePlan.of(bench.mot)))  # not packed yet
    pack_weights(bench.mot)  # what a GraphedDecode does when it binds
    assert decode_kernels_unsupported(bench.mot, DecodePlan.of(bench.mot)) is None
    bench.mot.layers[1].mlp.hidden_act = "relu2"  # a Nemotron-style MLP
    assert "SiLU" in str(decode_kernels_unsupported(bench.mot, DecodePlan.of(bench.mot)))


def test_fused_ops_triton_without_captured_decode_is_refused() -> None:
    from fv_cosmos3.cards import cosmos3_card
    from fv_kernel.api import ComputeOptions, InstanceOptions, build_instance

    for compute in (ComputeOptions(fused_ops="triton"), ComputeOptions(fused_ops="triton", cuda_graphs=True)):
        with pytest.raises(DecodeKernelsUnavailable, match="cuda_graphs=true on a CUDA device"):
            build_instance(cosmos3_card("cosmos3-tiny"), InstanceOptions(device="cpu", compute=compute))
    # 'torch', 'auto' and 'off' keep the composed step (and build on the CPU).
    for mode in ("torch", "auto", "off"):
        build_instance(cosmos3_card("cosmos3-tiny"), InstanceOptions(device="cpu", compute=ComputeOptions(fused_ops=mode)))


if __name__ == "__main__":  # run_kernel_checks' fresh-process run (TRITON_INTERPRET=1 set by the caller)
    print(json.dumps(kernel_checks("cpu")))
