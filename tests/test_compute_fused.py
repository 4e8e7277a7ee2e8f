"""Fused DiT glue ops: the torch reference equals the eager model; Triton kernels equal the reference.

The Triton kernels run on CUDA when there is one, else on CPU through Triton's interpreter
(the ``kernels`` fixture builds them under ``TRITON_INTERPRET=1``), so they are checked on
every machine where triton installs, CI included. CI sets ``FV_REQUIRE_TRITON_KERNELS=1``
(tox's ``kernel`` env): there a missing triton fails the kernel tests instead of skipping
them. The interpreter rounds fp32 -> bf16 toward zero (half the elements of a bf16 output
differ by one ulp from torch's round-to-nearest), so interpreter checks use fp32 tensors,
which test the indexing and the math exactly; CUDA checks use bf16.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

import fv_kernel.compute.fused as fused_module
from fv_kernel.compute.fused import (
    FusedOps,
    FusedOpsUnavailable,
    TorchFusedOps,
    TritonFusedOps,
    select_fused_ops,
    triton_available,
)

CUDA = torch.cuda.is_available()
#: Set by CI: the Triton kernels must run there, so a missing triton is a failure, not a skip.
REQUIRE_KERNELS = os.environ.get("FV_REQUIRE_TRITON_KERNELS") == "1"


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TritonFusedOps, str]]:
    """The Triton kernels and the device to feed them: CUDA, else Triton's CPU interpreter."""
    if not triton_available():
        if REQUIRE_KERNELS:
            pytest.fail("FV_REQUIRE_TRITON_KERNELS=1 but triton is not importable: the Triton kernels would not be tested")
        pytest.skip("needs triton (on CUDA, or on CPU through its interpreter)")
    if CUDA:
        yield TritonFusedOps(), "cuda"
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by triton.jit, i.e. when TritonFusedOps() builds the kernels
    ops = TritonFusedOps()
    assert ops.interpreted, "TRITON_INTERPRET=1 was set but Triton compiled the kernels for a GPU"
    yield ops, "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_selection_is_explicit() -> None:
    assert select_fused_ops("cpu", "off") is None
    assert select_fused_ops("cpu", "auto") is None  # Triton only on CUDA
    assert isinstance(select_fused_ops("cpu", "torch"), TorchFusedOps)
    with pytest.raises(FusedOpsUnavailable, match="CUDA"):
        select_fused_ops("cpu", "triton")
    with pytest.raises(ValueError, match="'off', 'auto', 'torch', 'triton'"):
        select_fused_ops("cpu", "fast")


def _mismatches(fused: FusedOps, ref: FusedOps, device: str, *, per_token: bool) -> dict[str, float]:
    """Every op (and variant) whose output differs from the reference beyond tolerance, with its error."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    g = torch.Generator().manual_seed(5 + per_token)
    batch, tokens, heads, head_dim = 2, 6, 4, 12
    width = heads * head_dim
    x, y = (torch.randn(batch, tokens, width, generator=g).to(device, dtype) for _ in range(2))
    mod = torch.randn(batch, tokens if per_token else 1, 6, width, generator=g).to(device)
    shift, scale, gate = mod.unbind(2)[:3]
    weight, bias = torch.randn(width, generator=g).to(device), torch.randn(width, generator=g).to(device)
    eps = 1e-6
    qk_weight = torch.randn(width, generator=g).to(device, dtype)
    cos, sin = (torch.randn(tokens, 1, head_dim // 2, generator=g).to(device) for _ in range(2))

    errors: dict[str, float] = {}
    errors["modulated_layer_norm"] = _rel(
        fused.modulated_layer_norm(x, scale, shift, eps), ref.modulated_layer_norm(x, scale, shift, eps)
    )
    errors["gated_residual"] = _rel(fused.gated_residual(x, y, gate), ref.gated_residual(x, y, gate))
    for label, kwargs, g_ in (("affine", {"weight": weight, "bias": bias}, gate), ("modulated", {"scale": scale, "shift": shift}, None)):
        got = fused.residual_layer_norm(x, y, g_, eps, **kwargs)
        want = ref.residual_layer_norm(x, y, g_, eps, **kwargs)
        errors[f"residual_layer_norm[{label}].residual"] = _rel(got[0], want[0])
        errors[f"residual_layer_norm[{label}].normed"] = _rel(got[1], want[1])
    for label, rotary in (("rope", (cos, sin)), ("no_rope", None)):
        got = fused.qk_rms_norm_rope(x, qk_weight, eps, heads, rotary)
        assert got.shape == (batch, tokens, heads, head_dim)
        errors[f"qk_rms_norm_rope[{label}]"] = _rel(got, ref.qk_rms_norm_rope(x, qk_weight, eps, heads, rotary))
    return {name: err for name, err in errors.items() if not err < tol}


@pytest.mark.parametrize("per_token", [False, True])
def test_triton_kernels_match_reference(kernels: tuple[TritonFusedOps, str], per_token: bool) -> None:
    fused, device = kernels
    assert _mismatches(fused, TorchFusedOps(), device, per_token=per_token) == {}


def test_kernel_comparison_catches_per_token_modulation_read_as_per_sample(
    kernels: tuple[TritonFusedOps, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: kernels fed the first token's modulation for every token must fail the comparison."""
    fused, device = kernels
    monkeypatch.setattr(fused_module, "_broadcast_rows", lambda mod, like: mod[:, :1].expand(like.shape))
    failing = _mismatches(fused, TorchFusedOps(), device, per_token=True)
    assert {"modulated_layer_norm", "gated_residual", "residual_layer_norm[modulated].normed"} <= set(failing), failing
    assert _mismatches(fused, TorchFusedOps(), device, per_token=False) == {}  # per-sample modulation is unaffected


class _RopeTheOtherWay(TorchFusedOps):
    """A wrong reference: rotates each pair by -angle."""

    def qk_rms_norm_rope(self, x, weight, eps, heads, rotary):  # type: ignore[no-untyped-def]
        return super().qk_rms_norm_rope(x, weight, eps, heads, None if rotary is None else (rotary[0], -rotary[1]))


def test_kernel_comparison_catches_a_wrong_reference(kernels: tuple[TritonFusedOps, str]) -> None:
    """Negative control: a reference whose RoPE turns the other way differs from the kernels exactly there."""
    fused, device = kernels
    assert set(_mismatches(fused, _RopeTheOtherWay(), device, per_token=False)) == {"qk_rms_norm_rope[rope]"}


def test_triton_ops_refuse_cpu_tensors_outside_the_interpreter() -> None:
    if not triton_available():
        pytest.skip("needs triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the whole session runs under Triton's interpreter")
    ops = TritonFusedOps()  # kernels compile lazily: building them needs no GPU
    assert not ops.interpreted
    x = torch.randn(1, 2, 8)
    with pytest.raises(FusedOpsUnavailable, match="TRITON_INTERPRET=1"):
        ops.gated_residual(x, x, torch.randn(1, 1, 8))
