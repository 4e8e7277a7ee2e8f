"""The Wan DiT's fused block on the fp8_dynamic path: its norms and GELU hand e4m3 rows to the fp8 linears.

Where every linear reading a norm's (or the GELU's) output is an ``fp8_dynamic`` ``Fp8Linear``, the
fused block asks the ops for that output already quantized (``FusedOps.*_fp8``), instead of writing
it in the activation dtype for each linear to quantize again. With the reference ops the two routes
compute the same numbers, bit for bit; with the Triton kernels (on CUDA, or in Triton's interpreter
in a fresh Python) within the quantization's rounding ties. A negative control hands the linears
row 0's scale for every row and must be caught.
"""

from __future__ import annotations

import fnmatch
import json
from collections import Counter
from typing import Any

import pytest
import torch

from fv_kernel.compute.fp8 import QuantizedRows, quantize_linears
from fv_kernel.compute.fused import TorchFusedOps, TritonFusedOps
from fv_kernel.testing.triton_checks import run_kernel_checks
from fv_wan.fp8 import WAN_FP8_TARGETS
from fv_wan.models.transformer import WanTransformer, WanTransformerConfig, cast_for_inference

from test_compute_fused_wan import counting as count_ops

FP8_OPS = ("modulated_layer_norm_fp8", "residual_layer_norm_fp8", "gelu_tanh_fp8")


def _model(dtype: torch.dtype, *, mode: str = "fp8_dynamic", targets: tuple[str, ...] = WAN_FP8_TARGETS,
           device: str = "cpu") -> WanTransformer:
    torch.manual_seed(0)
    model = WanTransformer(WanTransformerConfig.tiny()).eval()
    with torch.no_grad():
        for p in model.parameters():  # no zero-initialised term may hide a wrong path
            p.copy_(torch.randn_like(p) * 0.3)
    model = cast_for_inference(model, dtype).to(device)
    paths = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and any(fnmatch.fnmatchcase(n, g) for g in targets)]
    # "auto", the kernel a loaded card's linears get (on CPU it runs the torch reference).
    quantize_linears(model, paths, mode=mode, kernel="auto")
    return model.requires_grad_(False)


def _inputs(device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 16, 3, 8, 6, generator=g).to(device)
    return latents, torch.tensor([999.0, 17.5], device=device), torch.randn(2, 10, 32, generator=g).to(device)


def counting(ops: Any) -> Counter[str]:
    return count_ops(ops, FP8_OPS)


def _each_linear_quantizes(ops_class: type = TorchFusedOps) -> Any:
    """``ops_class``'s ops on the route without the fp8 ops: every fp8 linear quantizes its own activation-dtype input."""

    class EachLinearQuantizes(ops_class):  # type: ignore[misc, valid-type]
        def takes_quantized_rows(self, *consumers: torch.nn.Module) -> bool:
            return False

    return EachLinearQuantizes()


class _RowZerosScale(TorchFusedOps):
    """Negative control: the fused norm hands every row row 0's scale."""

    def modulated_layer_norm_fp8(self, *args: Any, **kwargs: Any) -> QuantizedRows:
        rows = super().modulated_layer_norm_fp8(*args, **kwargs)
        return QuantizedRows(rows.data, rows.scale[:1].expand_as(rows.scale).contiguous(), rows.shape, rows.dtype)


def _run(model: WanTransformer, ops: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    model.set_fused_ops(ops)
    with torch.no_grad():
        return model(*inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_ops_are_bitwise_each_linear_quantizing_its_own_input(dtype: torch.dtype) -> None:
    model, inputs = _model(dtype), _inputs()
    ops = TorchFusedOps()
    calls = counting(ops)
    fused = _run(model, ops, inputs)
    # Per block: norm1 for q/k/v, norm2 (cross-attention's affine norm) and norm3 for the FFN, the GELU for net.2.
    blocks = len(model.blocks)
    assert calls == {"modulated_layer_norm_fp8": blocks, "residual_layer_norm_fp8": 2 * blocks, "gelu_tanh_fp8": blocks}
    assert torch.equal(fused, _run(model, _each_linear_quantizes(), inputs))


def test_a_wrong_scale_from_the_fused_norm_is_caught() -> None:
    model, inputs = _model(torch.float32), _inputs()
    right = _run(model, _each_linear_quantizes(), inputs)
    wrong = _run(model, _RowZerosScale(), inputs)
    assert ((wrong - right).norm() / right.norm()).item() > 1e-2


def test_a_norm_read_by_any_other_linear_stays_in_the_activation_dtype() -> None:
    # Only attn1's q is fp8: k and v need norm1's bf16 rows, so norm1 is not quantized (q quantizes itself);
    # fp8_weights linears take no quantized rows at all.
    for model in (_model(torch.float32, targets=("blocks.*.attn1.to_q",)), _model(torch.float32, mode="fp8_weights")):
        ops = TorchFusedOps()
        calls = counting(ops)
        assert torch.equal(_run(model, ops, _inputs()), _run(model, _each_linear_quantizes(), _inputs()))
        assert sum(calls.values()) == 0, calls


def test_the_causal_block_hands_its_fp8_linears_quantized_rows_too() -> None:
    from test_causal_fused import _batched, _case

    model = _model(torch.float32)
    case = _case(model, "cpu", rows=2)  # rows at different start frames over histories of different lengths
    ops = TorchFusedOps()
    calls = counting(ops)
    model.set_fused_ops(ops)
    fused = _batched(model, case)
    blocks = len(model.blocks)
    assert calls == {"modulated_layer_norm_fp8": blocks, "residual_layer_norm_fp8": 2 * blocks, "gelu_tanh_fp8": blocks}
    model.set_fused_ops(_each_linear_quantizes())
    assert torch.equal(fused, _batched(model, case))


def triton_fp8_block_check(device: str) -> dict[str, Any]:
    """The tiny DiT on fp8_dynamic with the Triton ops, fused quantization against each linear quantizing."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter truncates bf16 casts
    model, inputs = _model(dtype, device=device), _inputs(device)
    ops = TritonFusedOps()
    calls = counting(ops)
    fused = _run(model, ops, inputs).float()

    composed = _run(model, _each_linear_quantizes(TritonFusedOps), inputs).float()
    return {"rel": ((fused - composed).norm() / composed.norm()).item(), "calls": dict(calls),
            "finite": bool(torch.isfinite(fused).all())}


def test_triton_fused_quantization_matches_the_composed_route() -> None:
    result = run_kernel_checks(__file__, lambda: triton_fp8_block_check("cuda"), what="the Triton kernels")
    assert result["finite"] and set(result["calls"]) == set(FP8_OPS), result
    # The norms are bitwise; the GELU's tanh differs from torch's in the last fp32 bits, which can move a
    # value on an e4m3 rounding boundary to the neighbouring code (docs/precision.md).
    assert result["rel"] < 5e-3, result


if __name__ == "__main__":  # the test's fresh-process run (TRITON_INTERPRET=1 set by the caller)
    torch.set_num_threads(1)
    print(json.dumps(triton_fp8_block_check("cpu")))


def test_a_lora_on_a_fused_site_gets_the_activations_and_every_row_its_own_update() -> None:
    """A LoRA routed per row on attn1's q (``rows_adapted``) reads norm1's output itself: the fused block then
    keeps that site in the activation dtype (q, k and v quantize their own input), and each row gets its
    own update, as on the route without the fp8 ops."""
    from fv_kernel.compute.lora import AdapterWeights, LowRankUpdate, RowAdapters, rows_adapted

    model, inputs = _model(torch.float32), _inputs()
    q = model.get_submodule("blocks.0.attn1.to_q")
    g = torch.Generator().manual_seed(5)
    update = LowRankUpdate(down=torch.randn(4, q.in_features, generator=g), up=torch.randn(q.out_features, 4, generator=g))
    adapter = AdapterWeights(name="q-lora", component="transformer", low_rank={"blocks.0.attn1.to_q": update})
    routing = RowAdapters.from_stacks([((adapter, 1.0),), ()])  # row 0 adapted, row 1 not
    ops = TorchFusedOps()
    calls = counting(ops)
    with rows_adapted(model, routing):
        adapted = _run(model, ops, inputs)
        each_quantizes = _run(model, _each_linear_quantizes(), inputs)
    blocks = len(model.blocks)
    # Block 0's norm1 stays in fp32 for the hooked q; every other site still hands over e4m3 rows.
    assert calls == {"modulated_layer_norm_fp8": blocks - 1, "residual_layer_norm_fp8": 2 * blocks, "gelu_tanh_fp8": blocks}
    assert torch.equal(adapted, each_quantizes)
    plain = _run(model, TorchFusedOps(), inputs)
    assert not torch.equal(adapted[0], plain[0]) and torch.equal(adapted[1], plain[1])
