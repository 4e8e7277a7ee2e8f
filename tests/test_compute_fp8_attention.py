"""The ``fp8`` attention driver's torch path and selection, and Fp8Linear's kernel choice (CPU, no interpreter).

The Triton kernels themselves are checked in tests/test_compute_fp8_kernels.py. References here
are fp64 softmax attention written in this file.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fv_kernel.compute import fp8_attention
from fv_kernel.compute.attention_backends import AttentionBackendUnavailable
from fv_kernel.compute.fp8 import Fp8Error, Fp8Linear
from fv_kernel.compute.fp8_attention import (
    PARITY_REL_ERROR,
    Fp8Attention,
    fp8_attention_torch,
)
from fv_kernel.compute.fused import triton_available
from fv_kernel.plugins.registry import kernel_registry


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1) @ v.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _qkv(lq: int = 130, lk: int = 130, d: int = 64, heads: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, n, d, generator=g) for n in (lq, lk, lk))


def test_fp8_is_a_registered_attention_driver() -> None:
    """Declared in the kernel's manifest and its entry points (the registry reads the installed
    entry points, so a checkout that was not reinstalled may not list it yet)."""
    import tomllib
    from pathlib import Path

    import yaml

    import fv_kernel
    from fv_kernel.card.refs import import_object

    root = Path(fv_kernel.__file__).parent
    manifest = yaml.safe_load((root / "fv-plugin.yaml").read_text())
    targets = {e["name"]: e["target"] for e in manifest["contributions"]["attention_backends"]}
    entry_points = tomllib.loads((root.parent / "pyproject.toml").read_text())["project"]["entry-points"]
    assert targets["fp8"] == entry_points["fv.attention_backends"]["fp8"] == "fv_kernel.compute.fp8_attention:Fp8Attention"
    try:
        driver = kernel_registry().attention_backend("fp8")
    except Exception:  # noqa: BLE001 - installed metadata older than this checkout
        driver = import_object(targets["fp8"])()
    assert isinstance(driver, Fp8Attention) and driver.name == "fp8"
    q, k, v = _qkv()
    assert not driver._uses_triton(q.device)  # CPU: the torch reference
    torch.testing.assert_close(driver.attend(q, k, v), fp8_attention_torch(q, k, v))


@pytest.mark.parametrize("shape", [(130, 130, 64), (17, 200, 48), (64, 1, 32)])
def test_torch_path_meets_its_parity_bound(shape: tuple[int, int, int]) -> None:
    q, k, v = _qkv(*shape)
    k = k + 4.0  # a shared key offset, removed by the smoothing
    err = _rel(Fp8Attention("torch").attend(q, k, v), _exact(q, k, v))
    assert err < PARITY_REL_ERROR
    if shape[1] > 1:  # one key: softmax is 1 and v is exact at its own per-channel scale
        assert err > 1e-3  # it is quantized: not the fp32 path under another name


def test_parity_check_catches_a_dropped_v_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: V dequantized without its per-channel scale fails the bound."""
    q, k, v = _qkv()
    quantize_kv = fp8_attention.quantize_kv

    def dropped(k_: torch.Tensor, v_: torch.Tensor):  # type: ignore[no-untyped-def]
        kq, ks, vq, vs = quantize_kv(k_, v_)
        return kq, ks, vq, torch.full_like(vs, 1 / 448)

    monkeypatch.setattr(fp8_attention, "quantize_kv", dropped)
    assert _rel(fp8_attention_torch(q * 3, k * 3, v * 3), _exact(q * 3, k * 3, v * 3)) > PARITY_REL_ERROR


def test_parity_check_catches_a_k_scale_on_the_wrong_axis(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: K scaled per channel instead of per block of tokens (dequantized per block) fails."""
    q, k, v = _qkv(d=64)
    k = k * torch.logspace(-1, 1, 64)

    quantize_blocks = fp8_attention.quantize_blocks

    def per_channel(t: torch.Tensor, block: int):  # type: ignore[no-untyped-def]
        if block != fp8_attention.K_BLOCK:  # Q (one scale per row) stays right
            return quantize_blocks(t, block)
        s = (t.float().abs().amax(dim=1) / 448).clamp(min=1e-12)  # [BH, D]
        return (t.float() / s[:, None, :]).to(torch.float8_e4m3fn), s[:, : -(-t.shape[1] // block)]

    monkeypatch.setattr(fp8_attention, "quantize_blocks", per_channel)
    assert _rel(fp8_attention_torch(q, k, v), _exact(q, k, v)) > PARITY_REL_ERROR


def test_large_values_stay_finite_and_grouped_heads_expand() -> None:
    q, k, v = _qkv(heads=4)
    out = Fp8Attention("torch").attend(q * 1e4, k[:, :2] * 1e4, v[:, :2] * 1e4)
    assert out.shape == q.shape and torch.isfinite(out).all()
    grouped = Fp8Attention("torch").attend(q, k[:, :2], v[:, :2])
    torch.testing.assert_close(grouped, fp8_attention_torch(q, k[:, :2].repeat_interleave(2, 1), v[:, :2].repeat_interleave(2, 1)))


def test_bf16_inputs_give_bf16_outputs() -> None:
    q, k, v = (t.bfloat16() for t in _qkv())
    out = Fp8Attention("torch").attend(q, k, v)
    assert out.dtype == torch.bfloat16
    assert _rel(out, _exact(q, k, v)) < PARITY_REL_ERROR


def test_bad_input_gets_typed_errors() -> None:
    q, k, v = _qkv()
    driver = Fp8Attention("torch")
    with pytest.raises(AttentionBackendUnavailable, match="attn_mask"):
        driver.attend(q, k, v, attn_mask=torch.ones(130, 130, dtype=torch.bool))
    with pytest.raises(AttentionBackendUnavailable, match="is_causal"):
        driver.attend(q, k, v, is_causal=True)
    with pytest.raises(Fp8Error, match="'auto', 'triton' or 'torch'") as info:
        Fp8Attention("fast")  # type: ignore[arg-type]
    assert info.value.param == "implementation"
    with pytest.raises(Fp8Error, match="at least one key"):
        driver.attend(q, k[:, :, :0], v[:, :, :0])
    assert not driver.supports(dtype=torch.float32, device=q.device, head_dim=64, has_mask=True)


def test_triton_path_on_cpu_outside_the_interpreter_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if not triton_available():
        pytest.skip("needs triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from fv_kernel.compute import fp8_triton

    if fp8_triton.triton_interpreted():
        pytest.skip("this process imported triton under TRITON_INTERPRET=1")
    q, k, v = _qkv()
    with pytest.raises(fp8_triton.Fp8KernelUnavailable, match="TRITON_INTERPRET=1"):
        Fp8Attention("triton").attend(q, k, v)
    lin = Fp8Linear.from_linear(torch.nn.Linear(8, 4), mode="fp8_dynamic", kernel="triton")
    with pytest.raises(fp8_triton.Fp8KernelUnavailable, match="kernel='torch'"):
        lin(torch.randn(3, 8))


def test_kernel_launchers_name_what_does_not_fit() -> None:
    if not triton_available():
        pytest.skip("needs triton")
    from fv_kernel.compute.fp8_triton import (
        Fp8KernelError,
        fp8_attention_kernel,
        fp8_linear_triton,
    )

    q = torch.randn(1, 2, 8, 16)
    stats = torch.zeros(1, 2, 16)
    with pytest.raises(Fp8KernelError, match=r"v \(1, 2, 9, 16\)"):
        fp8_attention_kernel(q, q, torch.randn(1, 2, 9, 16), stats, stats, scale=0.25)
    with pytest.raises(Fp8KernelError, match="k_mean"):
        fp8_attention_kernel(q, q, q, stats[:, :1], stats, scale=0.25)
    with pytest.raises(Fp8KernelError, match="float16"):
        fp8_attention_kernel(q, q.half(), q, stats, stats, scale=0.25)
    for k_block in (64, 384):
        with pytest.raises(Fp8KernelError, match=f"power of two of at least 128, got {k_block}") as info:
            fp8_attention_kernel(q, q, q, stats, stats, scale=0.25, k_block=k_block)
        assert info.value.param == "k_block"
    w = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(Fp8KernelError, match="one per output channel"):
        fp8_linear_triton(torch.randn(3, 8), w, torch.ones(3), None, "fp8_dynamic", torch.float32)
    with pytest.raises(Fp8KernelError, match="do not fit"):
        fp8_linear_triton(torch.randn(3, 7), w, torch.ones(4), None, "fp8_dynamic", torch.float32)
    with pytest.raises(Fp8KernelError, match="'fp8_weights' or 'fp8_dynamic'"):
        fp8_linear_triton(torch.randn(3, 8), w, torch.ones(4), None, "int8", torch.float32)


# --------------------------------------------------------------------------- Fp8Linear kernel selection


def test_fp8_linear_auto_kernel_is_the_torch_reference_on_cpu() -> None:
    linear = torch.nn.Linear(32, 16)
    x = torch.randn(5, 32)
    for mode in ("fp8_weights", "fp8_dynamic"):
        auto = Fp8Linear.from_linear(linear, mode=mode)  # kernel="auto" by default
        ref = Fp8Linear.from_linear(linear, mode=mode, kernel="torch")
        assert torch.equal(auto(x), ref(x))
        assert _rel(auto(x), F.linear(x, linear.weight, linear.bias)) < 0.05


class _Cuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the kernel selection reads nothing else."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda")


@pytest.mark.parametrize(
    ("capability", "in_features", "has_triton", "expected"),
    [
        ((9, 0), 32, True, "scaled_mm"),  # Hopper: cuBLASLt with rowwise scales
        ((10, 0), 32, True, "scaled_mm"),
        ((9, 0), 24, True, "triton"),  # cuBLASLt needs sizes divisible by 16
        ((8, 9), 32, True, "triton"),  # Ada: no rowwise scaled_mm
        ((8, 9), 32, False, "torch"),
    ],
)
def test_fp8_linear_auto_kernel_on_cuda(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], in_features: int, has_triton: bool, expected: str,
) -> None:
    """The selection itself (CPU-checkable): which kernel a CUDA activation routes to."""
    from fv_kernel.compute import fp8

    called: list[str] = []
    for name in ("scaled_mm", "triton", "torch"):
        monkeypatch.setattr(fp8, f"_{name}_kernel", lambda *a, name=name: called.append(name) or a[0])
    monkeypatch.setattr(fp8, "triton_available", lambda: has_triton)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    x = torch.randn(2, in_features).as_subclass(_Cuda)
    fp8._auto_kernel(x, torch.zeros(16, in_features, dtype=torch.float8_e4m3fn), torch.ones(16), None, "fp8_dynamic",
                     torch.float32)
    assert called == [expected]


def test_scaled_mm_kernel_refuses_sizes_cublas_cannot_take() -> None:
    lin = Fp8Linear.from_linear(torch.nn.Linear(24, 16), mode="fp8_dynamic", kernel="scaled_mm")
    with pytest.raises(Fp8Error, match="divisible by 16, got 24 and 16; use kernel='triton'") as info:
        lin(torch.randn(3, 24))
    assert info.value.param == "kernel"


def test_fp8_linear_unknown_kernel_names_the_choices() -> None:
    with pytest.raises(Fp8Error, match="'auto', 'torch', 'scaled_mm', 'triton'") as info:
        Fp8Linear(8, 4, kernel="cutlass")
    assert info.value.param == "kernel"
