"""Attention drivers: registration, deliberate kernel choice, clear unavailability, GPU parity."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from fv_kernel.compute.attention import SDPAAttention
from fv_kernel.compute.attention_backends import (
    AttentionBackendUnavailable,
    FlashAttention2,
    FlashAttention3,
    SDPACudnnAttention,
    SDPAMathAttention,
    attention_callable,
)
from fv_kernel.plugins.registry import load_attention_backend
from fv_kernel.plugins.drivers import DriverRegistry
from fv_kernel.plugins.errors import UnknownDriverError

PINNED = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math")
CUDA = torch.cuda.is_available()


def _qkv(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, dim: int, **kw: object) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(q_len * 31 + kv_len)
    make = lambda h, n: torch.randn(batch, h, n, dim, generator=g).to(**kw)  # noqa: E731
    return make(heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len)


def test_every_backend_is_a_registered_driver() -> None:
    registry = DriverRegistry("attention_backends")
    assert {"sdpa", *PINNED, "flash_attn3", "flash_attn2"} <= set(registry.names())
    for name in PINNED:
        assert load_attention_backend(name, registry).name == name


def test_unknown_backend_names_the_available_ones() -> None:
    with pytest.raises(UnknownDriverError, match="sdpa_cudnn"):
        load_attention_backend("sdpa_cudnnn")


def test_math_backend_matches_sdpa_with_gqa_and_mask() -> None:
    q, k, v = _qkv(2, 4, 2, 7, 5, 8)
    mask = torch.rand(2, 1, 7, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True
    got = SDPAMathAttention().attend(q, k, v, attn_mask=mask)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_pinned_gpu_backend_refuses_cpu_inputs_by_name() -> None:
    backend = SDPACudnnAttention()
    assert not backend.supports(dtype=torch.bfloat16, device=torch.device("cpu"), head_dim=64, has_mask=False)
    with pytest.raises(AttentionBackendUnavailable, match="'sdpa_cudnn' needs a CUDA device"):
        backend.attend(*_qkv(1, 2, 2, 4, 4, 8))


@pytest.mark.parametrize("cls, module", [(FlashAttention3, "flash_attn_interface"), (FlashAttention2, "flash_attn")])
def test_flash_attention_drivers_say_which_package_is_missing(cls: type, module: str) -> None:
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    with pytest.raises(AttentionBackendUnavailable, match=repr(module)):
        cls()


def test_plain_sdpa_driver_keeps_the_models_own_call() -> None:
    assert attention_callable(SDPAAttention()) is F.scaled_dot_product_attention
    math = SDPAMathAttention()
    assert attention_callable(math) == math.attend


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn3", "flash_attn2"])
def test_gpu_backend_matches_fp64_reference(name: str) -> None:
    try:
        backend = load_attention_backend(name)
    except AttentionBackendUnavailable as exc:
        pytest.skip(str(exc))
    q, k, v = _qkv(2, 4, 4, 300, 300, 128, device="cuda", dtype=torch.bfloat16)
    reference = F.scaled_dot_product_attention(q.double().cpu(), k.double().cpu(), v.double().cpu())
    out = backend.attend(q, k, v)
    assert torch.isfinite(out).all()
    error = (out.double().cpu() - reference).norm() / reference.norm()
    assert error < 1e-2, f"{name}: relative error {error:.2e}"
