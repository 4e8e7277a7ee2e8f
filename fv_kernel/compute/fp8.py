"""FP8 (e4m3) weights and activations as data, and the linear that runs them (docs/precision.md).

A precision path decides what of a linear runs in fp8:

- ``fp8_weights``: the weight is stored in e4m3 with a scale per output channel (or one per
  tensor, as ComfyUI's ``*_fp8_scaled`` files carry it) and dequantized to the compute dtype for
  the matmul; activations stay in the compute dtype. Halves the weights' bytes; no fp8 math.
- ``fp8_dynamic``: the weight as above, and each row (token) of the activation quantized to e4m3
  with its own scale (absmax / 448) right before the GEMM; the GEMM multiplies e4m3 by e4m3 and
  accumulates in fp32 (``torch._scaled_mm`` on Hopper, rowwise scales).

:class:`Fp8Linear` holds the quantized weight and computes either path. Its ``kernel`` decides
how: ``"torch"`` is the portable reference (dequantize, then matmul in fp32: what every kernel is
checked against), ``"scaled_mm"`` calls cuBLASLt (CUDA, sm_89+: ``torch._scaled_mm`` after a
one-pass Triton per-token quantization for ``fp8_dynamic``; dequantize-then-GEMM for
``fp8_weights``), ``"triton"`` is :func:`fv_kernel.compute.fp8_triton.fp8_linear_triton` (any size,
sm_89+ or the interpreter), ``"auto"`` (the default) takes ``scaled_mm`` on Hopper and later where
the sizes divide by 16, Triton on other CUDA devices, and torch elsewhere; a callable replaces them all.
Quantization is done once, at load (:func:`quantize_linears`).

An ``fp8_dynamic`` linear also takes its activation already quantized, as :class:`QuantizedRows`:
the fused norm and GELU kernels (:class:`fv_kernel.compute.fused.FusedOps`, the ``*_fp8`` ops) write
e4m3 rows and their scales in the pass that computes them, so the bf16 activation is never written
and read back, and the three projections that share an input (q, k, v) quantize it once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fv_kernel.compute.triton_support import triton_available
from fv_kernel.errors import FvError

__all__ = [
    "E4M3_MAX",
    "Fp8Error",
    "Fp8Kernel",
    "Fp8Linear",
    "Fp8Mode",
    "QuantizedRows",
    "dequantize_e4m3",
    "quantize_e4m3",
    "quantize_linears",
    "quantize_rows_e4m3",
    "takes_quantized_rows",
]

#: The largest finite e4m3 value (``torch.finfo(torch.float8_e4m3fn).max``).
E4M3_MAX = 448.0
#: Scales never go below this, so an all-zero row or channel quantizes to zeros, not NaN.
_MIN_SCALE = 1e-12

Fp8Mode = Literal["fp8_weights", "fp8_dynamic"]
#: ``kernel(x2d, weight_e4m3, weight_scale, bias, mode, out_dtype) -> y2d``; ``x2d`` is a tensor, or
#: (``fp8_dynamic`` only) a 2-D :class:`QuantizedRows`.
Fp8Kernel = Callable[
    ["torch.Tensor | QuantizedRows", torch.Tensor, torch.Tensor, "torch.Tensor | None", str, torch.dtype], torch.Tensor
]


class Fp8Error(FvError, ValueError):
    """A tensor or module that cannot be quantized or run in fp8 as asked."""

    error_type = "invalid_precision"


def quantize_e4m3(t: torch.Tensor, *, axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as e4m3 and its fp32 scales, ``t ≈ q.float() · scale``.

    ``axis=None``: one scale for the tensor. ``axis=k``: one scale per index of dimension ``k``
    (a weight ``[out, in]`` with ``axis=0`` has a scale per output channel), shaped to broadcast
    against ``t`` (``[out, 1]``). Scales are ``absmax / 448``, so nothing saturates.
    """
    t32 = t.detach().float()
    if axis is None:
        amax = t32.abs().amax()
    else:
        dims = [d for d in range(t32.dim()) if d != axis % t32.dim()]
        amax = t32.abs().amax(dim=dims, keepdim=True)
    scale = (amax / E4M3_MAX).clamp(min=_MIN_SCALE)
    q = (t32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(()) if axis is None else scale


def dequantize_e4m3(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.float() · scale`` in ``dtype`` (``scale`` broadcasts: a scalar, or per channel)."""
    return (q.float() * scale.float()).to(dtype)


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization of a 2-D activation ``[M, K]``: e4m3 and an fp32 scale ``[M, 1]``."""
    if x.dim() != 2:
        raise Fp8Error(f"per-row quantization takes a 2-D activation, got shape {tuple(x.shape)}")
    return quantize_e4m3(x, axis=0)


@dataclass(frozen=True)
class QuantizedRows:
    """An activation quantized per token, standing for a tensor of ``shape`` and ``dtype``.

    ``data`` is e4m3 ``[M, K]`` and ``scale`` fp32 ``[M, 1]`` (``activation ≈ data.float() · scale``),
    with ``M`` the product of ``shape[:-1]`` and ``K = shape[-1]``; ``dtype`` is what the activation
    was (the dtype an :class:`Fp8Linear` given these rows returns).
    """

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    def __post_init__(self) -> None:
        rows = math.prod(self.shape[:-1]) if len(self.shape) else -1
        if (self.data.dtype != torch.float8_e4m3fn or tuple(self.data.shape) != (rows, *self.shape[-1:])
                or self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (rows, 1)):
            raise Fp8Error(
                f"QuantizedRows needs e4m3 data [M, K] and fp32 scale [M, 1] for an activation of shape (..., K) "
                f"with M rows; got data {tuple(self.data.shape)} {self.data.dtype}, scale {tuple(self.scale.shape)} "
                f"{self.scale.dtype}, shape {tuple(self.shape)}"
            )

    @classmethod
    def quantize(cls, x: torch.Tensor) -> QuantizedRows:
        """``x (..., K)`` quantized per row: one Triton pass on CUDA (when triton imports), else torch."""
        data, scale = _quantize_rows_fast(x.reshape(-1, x.shape[-1]).contiguous())
        return cls(data, scale, x.shape, x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The activation these rows stand for, ``data · scale`` in ``dtype``, shaped as ``shape``."""
        return dequantize_e4m3(self.data, self.scale, dtype).reshape(self.shape)


def _quantized(x: torch.Tensor | QuantizedRows, mode: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``x``'s e4m3 rows and scales when it arrives quantized (``fp8_dynamic`` only), else None."""
    if not isinstance(x, QuantizedRows):
        return None
    if mode != "fp8_dynamic":
        raise Fp8Error(f"a quantized activation runs only on an fp8_dynamic linear, this one is {mode!r}", param="mode")
    return x.data, x.scale


def _torch_kernel(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, mode: str, out_dtype: torch.dtype,
) -> torch.Tensor:
    """The reference: dequantize, then one fp32 matmul (what ``_scaled_mm`` computes, to rounding)."""
    prequantized = _quantized(x, mode)
    w = dequantize_e4m3(weight, scale.reshape(-1, 1) if scale.dim() else scale)
    if mode == "fp8_dynamic":
        xq, xs = prequantized or quantize_rows_e4m3(x)
        x32 = dequantize_e4m3(xq, xs)
    else:
        x32 = x.float()
    y = x32 @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _quantize_rows_fast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization in one Triton pass on CUDA (when triton imports), else in torch."""
    if x.device.type == "cuda" and triton_available():
        from fv_kernel.compute.fp8_triton import fp8_quantize_rows

        return fp8_quantize_rows(x)
    return quantize_rows_e4m3(x)


def _scaled_mm_kernel(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, mode: str, out_dtype: torch.dtype,
) -> torch.Tensor:
    """cuBLASLt (CUDA, sm_89+). ``fp8_dynamic``: the activation quantized per token (one Triton pass),
    then ``torch._scaled_mm`` with rowwise scales, e4m3 x e4m3 with fp32 accumulation. ``fp8_weights``:
    the weight dequantized to the activation's dtype for this call, then a bf16/fp16 GEMM (a mixed
    e4m3 x bf16 tensor-core GEMM does not exist on Hopper; widening in a Triton GEMM's registers ran
    2.3-3.3x slower than cuBLAS, docs/benchmarks.md)."""
    prequantized = _quantized(x, mode)
    if mode != "fp8_dynamic":
        w = dequantize_e4m3(weight, scale.reshape(-1, 1) if scale.dim() else scale, x.dtype)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype)).to(out_dtype)
    if weight.shape[1] % 16 or weight.shape[0] % 16:  # cuBLASLt's rule; caught here, not deep inside torch
        raise Fp8Error(
            f"kernel 'scaled_mm' needs in_features and out_features divisible by 16, got {weight.shape[1]} and "
            f"{weight.shape[0]}; use kernel='triton' (any size) or 'torch'", param="kernel",
        )
    xq, xs = prequantized or _quantize_rows_fast(x.contiguous())
    w_scale = (scale.reshape(1, -1) if scale.dim() else scale.reshape(1, 1).expand(1, weight.shape[0])).float().contiguous()
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=w_scale, out_dtype=torch.bfloat16,
                         bias=None if bias is None else bias.to(torch.bfloat16))
    return y.to(out_dtype)


def _triton_kernel(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, mode: str, out_dtype: torch.dtype,
) -> torch.Tensor:
    """The Triton kernel, imported on first use (triton is optional)."""
    if not triton_available():
        raise Fp8Error("kernel 'triton' needs the triton package, which is not installed; use kernel='torch'",
                       param="kernel")
    from fv_kernel.compute.fp8_triton import fp8_linear_triton

    if mode not in ("fp8_weights", "fp8_dynamic"):
        raise Fp8Error(f"mode must be 'fp8_weights' or 'fp8_dynamic', got {mode!r}", param="mode")
    prequantized = _quantized(x, mode)
    if prequantized is not None:
        return fp8_linear_triton(prequantized[0], weight, scale, bias, mode, out_dtype, x_scale=prequantized[1])
    return fp8_linear_triton(x, weight, scale, bias, mode, out_dtype)


#: The first CUDA capability whose cuBLASLt takes ``_scaled_mm`` with rowwise (per-token x per-channel) scales.
_ROWWISE_SCALED_MM_CAPABILITY = (9, 0)


def _auto_kernel(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, mode: str, out_dtype: torch.dtype,
) -> torch.Tensor:
    """The fastest kernel that can run: cuBLASLt (``scaled_mm``) on Hopper and later when the sizes
    divide by 16, else Triton on CUDA when importable, else the torch reference."""
    device = x.data.device if isinstance(x, QuantizedRows) else x.device  # rows quantized by the op before
    if device.type != "cuda":
        kernel = _torch_kernel
    elif (torch.cuda.get_device_capability(device) >= _ROWWISE_SCALED_MM_CAPABILITY
          and weight.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0):
        kernel = _scaled_mm_kernel
    else:
        kernel = _triton_kernel if triton_available() else _torch_kernel
    return kernel(x, weight, scale, bias, mode, out_dtype)


_KERNELS: dict[str, Fp8Kernel] = {
    "auto": _auto_kernel, "torch": _torch_kernel, "scaled_mm": _scaled_mm_kernel, "triton": _triton_kernel,
}


class Fp8Linear(nn.Module):
    """A linear whose weight is e4m3 with fp32 scales (per output channel ``[out]``, or one).

    The weight and its scale are buffers: they load and save with the state dict (keys
    ``weight`` and ``weight_scale``, the names ComfyUI's current format and ModelOpt use).
    """

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = True, mode: Fp8Mode = "fp8_weights",
        per_channel: bool = True, kernel: str | Fp8Kernel = "auto", device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if mode not in ("fp8_weights", "fp8_dynamic"):
            raise Fp8Error(f"mode must be 'fp8_weights' or 'fp8_dynamic', got {mode!r}", param="mode")
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features if per_channel else (), dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False) if bias else None
        self.kernel = kernel

    @property
    def kernel(self) -> Fp8Kernel:
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: str | Fp8Kernel) -> None:
        if isinstance(kernel, str):
            if kernel not in _KERNELS:
                raise Fp8Error(f"kernel must be one of {', '.join(map(repr, _KERNELS))} or a callable, got {kernel!r}",
                               param="kernel")
            kernel = _KERNELS[kernel]
        self._kernel = kernel

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, mode: Fp8Mode = "fp8_weights", per_channel: bool = True,
                    kernel: str | Fp8Kernel = "auto") -> Fp8Linear:
        """``linear``'s weight quantized (scale per output channel, or one per tensor); its bias kept as is."""
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, mode=mode,
                     per_channel=per_channel, kernel=kernel, device=linear.weight.device,
                     bias_dtype=linear.bias.dtype if linear.bias is not None else torch.float32)
        q, scale = quantize_e4m3(linear.weight, axis=0 if per_channel else None)
        with torch.no_grad():
            module.weight.copy_(q)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if linear.bias is not None:
                module.bias.copy_(linear.bias)
        # In the mode of the layer it replaces: quantizing a model in eval mode leaves no layer in training mode.
        return module.train(linear.training)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.weight_scale.reshape(-1, 1) if self.weight_scale.dim() else self.weight_scale
        return dequantize_e4m3(self.weight, scale, dtype)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """``x`` (..., in_features), or (``fp8_dynamic``) its :class:`QuantizedRows`; returns (..., out_features)
        in the activation's dtype."""
        if x.shape[-1] != self.in_features:
            raise Fp8Error(f"Fp8Linear takes {self.in_features} input features, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        # Checked here too, not only in the built-in kernels: a callable kernel may not know QuantizedRows.
        rows = x if _quantized(x, self.mode) is not None else x.reshape(-1, self.in_features)
        y = self._kernel(rows, self.weight, self.weight_scale, self.bias, self.mode, x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        scales = "per-channel" if self.weight_scale.dim() else "per-tensor"
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, {scales} scales"


def takes_quantized_rows(*modules: nn.Module) -> bool:
    """Whether every module given takes :class:`QuantizedRows` (each an ``fp8_dynamic`` :class:`Fp8Linear`
    with no forward hook), so that their shared input may be quantized once, in the op that computes it.
    A hooked one reads its input as given: a LoRA routed per row (``rows_adapted``) computes its update
    from the activations themselves, not from their e4m3 rows."""
    return bool(modules) and all(
        isinstance(m, Fp8Linear) and m.mode == "fp8_dynamic" and not m._forward_hooks for m in modules
    )


def quantize_linears(
    root: nn.Module, targets: Iterable[str], *, mode: Fp8Mode, per_channel: bool = True, kernel: str | Fp8Kernel = "auto",
) -> list[str]:
    """Replace each ``nn.Linear`` of ``root`` named in ``targets`` by an :class:`Fp8Linear` of its
    weights (quantized once, here). Returns the paths replaced; a path that is not a linear of
    ``root`` is an :class:`Fp8Error` naming it, and nothing is replaced."""
    targets = list(targets)
    linears = {name for name, module in root.named_modules() if isinstance(module, nn.Linear)}
    missing = [t for t in targets if t not in linears]
    if missing:
        raise Fp8Error(f"{len(missing)} fp8 target(s) are not linears of the module: {', '.join(missing[:6])}",
                       param="precision")
    for path in targets:
        parent_path, _, leaf = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        setattr(parent, leaf, Fp8Linear.from_linear(getattr(parent, leaf), mode=mode, per_channel=per_channel, kernel=kernel))
    return targets
