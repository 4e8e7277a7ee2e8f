"""Fused DiT glue ops: the torch reference equals the eager model; Triton kernels equal the reference.

The Triton kernels run on CUDA when there is one, else on CPU in Triton's interpreter, so
they are checked on every machine where triton installs, CI included. Triton reads
``TRITON_INTERPRET`` when ``triton.language`` is first imported (its own helpers such as
``tl.sum`` are decorated then), and torch and diffusers import it as a side effect, so the
interpreter checks run this file as a script in a fresh Python with ``TRITON_INTERPRET=1``
set from the start. CI sets ``FV_REQUIRE_TRITON_KERNELS=1`` (tox's ``kernel`` env): there a
missing triton fails the kernel tests instead of skipping them. The interpreter rounds
fp32 -> bf16 toward zero (half the elements of a bf16 output differ by one ulp from
torch's round-to-nearest), so interpreter checks use fp32 tensors, which test the indexing
and the math exactly; CUDA checks use bf16.
"""

from __future__ import annotations

import json
from typing import Any

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
from fv_kernel.testing.triton_checks import run_kernel_checks

CUDA = torch.cuda.is_available()
#: Set by CI: the Triton kernels must run there, so a missing triton is a failure, not a skip.


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


# --------------------------------------------------------------------------- kernels vs reference


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
    video = torch.randn(2, 6, 3, 4, 5, generator=g).to(device, dtype)
    channel_bias = torch.randn(6, generator=g).to(device, dtype)
    for label, layout in (("channels_last", torch.channels_last_3d), ("contiguous", torch.contiguous_format)):
        x = video.contiguous(memory_format=layout)
        got = fused.channel_bias_add_(x.clone(memory_format=layout), channel_bias)
        errors[f"channel_bias_add_[{label}]"] = _rel(got, ref.channel_bias_add_(x.clone(memory_format=layout), channel_bias))
    return {name: err for name, err in errors.items() if not err < tol}


class _BiasOfTheNextChannel(TorchFusedOps):
    """A wrong reference: each channel gets the next channel's bias."""

    def channel_bias_add_(self, x, bias):  # type: ignore[no-untyped-def]
        return super().channel_bias_add_(x, bias.roll(1))


class _RopeTheOtherWay(TorchFusedOps):
    """A wrong reference: rotates each pair by -angle."""

    def qk_rms_norm_rope(self, x, weight, eps, heads, rotary):  # type: ignore[no-untyped-def]
        return super().qk_rms_norm_rope(x, weight, eps, heads, None if rotary is None else (rotary[0], -rotary[1]))


def _first_token_modulation(mod: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A broken broadcast: every token gets the first token's modulation (per-token read as per-sample)."""
    return mod[:, :1].expand(like.shape)


def kernel_checks(device: str) -> dict[str, Any]:
    """The kernels against the reference, and the negative controls, as ``{check: mismatching ops}``."""
    fused = TritonFusedOps()
    out: dict[str, Any] = {"interpreted": fused.interpreted}
    out["per_sample"] = _mismatches(fused, TorchFusedOps(), device, per_token=False)
    out["per_token"] = _mismatches(fused, TorchFusedOps(), device, per_token=True)
    out["wrong_rope_reference"] = _mismatches(fused, _RopeTheOtherWay(), device, per_token=False)
    out["wrong_bias_reference"] = _mismatches(fused, _BiasOfTheNextChannel(), device, per_token=False)
    broadcast = fused_module._broadcast_rows
    fused_module._broadcast_rows = _first_token_modulation
    try:
        out["first_token_modulation[per_token]"] = _mismatches(fused, TorchFusedOps(), device, per_token=True)
        out["first_token_modulation[per_sample]"] = _mismatches(fused, TorchFusedOps(), device, per_token=False)
    finally:
        fused_module._broadcast_rows = broadcast
    return out


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
    """:func:`kernel_checks` on CUDA, else in a fresh Python under Triton's interpreter."""
    results = run_kernel_checks(__file__, lambda: kernel_checks("cuda"), what="the Triton kernels")
    assert CUDA or results["interpreted"], "TRITON_INTERPRET=1 was set but Triton compiled the kernels for a GPU"
    return results


@pytest.mark.parametrize("check", ["per_sample", "per_token"])
def test_triton_kernels_match_reference(kernels: dict[str, Any], check: str) -> None:
    assert kernels[check] == {}


def test_kernel_comparison_catches_per_token_modulation_read_as_per_sample(kernels: dict[str, Any]) -> None:
    """Negative control: kernels fed the first token's modulation for every token must fail the comparison."""
    failing = kernels["first_token_modulation[per_token]"]
    assert {"modulated_layer_norm", "gated_residual", "residual_layer_norm[modulated].normed"} <= set(failing), failing
    assert kernels["first_token_modulation[per_sample]"] == {}  # per-sample modulation is unaffected


def test_kernel_comparison_catches_a_wrong_reference(kernels: dict[str, Any]) -> None:
    """Negative controls: a reference whose RoPE turns the other way, or that adds each channel its neighbour's
    bias, differs from the kernels exactly there."""
    assert set(kernels["wrong_rope_reference"]) == {"qk_rms_norm_rope[rope]"}
    assert set(kernels["wrong_bias_reference"]) == {"channel_bias_add_[channels_last]", "channel_bias_add_[contiguous]"}


# --------------------------------------------------------------------------- typed errors


def test_triton_ops_refuse_cpu_tensors_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not triton_available():
        pytest.skip("needs triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ops = TritonFusedOps()  # kernels compile lazily: building them needs no GPU
    assert not ops.interpreted
    x = torch.randn(1, 2, 8)
    with pytest.raises(FusedOpsUnavailable, match="TRITON_INTERPRET=1"):
        ops.gated_residual(x, x, torch.randn(1, 1, 8))


def test_interpreter_switched_on_after_triton_was_imported_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if not triton_available():
        pytest.skip("needs triton")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.sum, InterpretedFunction):
        pytest.skip("this process imported triton under TRITON_INTERPRET=1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(FusedOpsUnavailable, match="before the process imports triton"):
        TritonFusedOps()


if __name__ == "__main__":  # the fixture's fresh-process run (TRITON_INTERPRET=1 set by the caller)
    print(json.dumps(kernel_checks("cpu")))
