"""Adapter files: reading safetensors with metadata, and the generic diffusers/PEFT converter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fv_kernel.card.adapters import read_adapter_bytes, read_adapter_file
from fv_kernel.compute.lora import AdapterError, AdapterKeyError, merge_adapters
from fv_kernel.errors import AdapterFileError
from fv_kernel.model.adapters import PEFT_METADATA_KEY, convert_peft
from fv_kernel.testing.adapters import peft_lora_tensors, write_peft_lora


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.ModuleDict({"q": nn.Linear(6, 6), "ff": nn.Linear(6, 10)}) for _ in range(2))
        self.out = nn.Linear(10, 3)


def _reference(net: Net, tensors: dict[str, torch.Tensor], path: str, alpha: float | None, strength: float) -> torch.Tensor:
    """W + s·(α/r)·B·A written out by hand, from the raw file tensors."""
    a = tensors[f"transformer.{path}.lora_A.weight"].double()
    b = tensors[f"transformer.{path}.lora_B.weight"].double()
    scale = 1.0 if alpha is None else alpha / a.shape[0]
    return (net.get_submodule(path).weight.double() + strength * scale * (b @ a)).float()


def _merged_weight(net: Net, weights: dict, path: str, strength: float) -> torch.Tensor:
    merged = merge_adapters(net, [(weights["transformer"], strength)])
    out = net.get_submodule(path).weight.detach().clone()
    merged.restore()
    return out


@pytest.mark.parametrize("strength", [0.5, 1.0])
def test_alpha_entries_scale_the_update_like_peft(strength: float) -> None:
    net = Net()
    tensors = peft_lora_tensors(net, "transformer", ["blocks.0.q", "out"], rank=2, alpha=8.0)
    weights = convert_peft(tensors, name="style", metadata={})
    assert set(weights) == {"transformer"} and weights["transformer"].low_rank["out"].alpha == 8.0
    for path in ("blocks.0.q", "out"):
        got = _merged_weight(net, weights, path, strength)
        torch.testing.assert_close(got, _reference(net, tensors, path, 8.0, strength), rtol=0, atol=1e-6)
        # Negative control: the same check catches a converter that drops alpha (scale 1 instead of 4).
        assert not torch.allclose(got, _reference(net, tensors, path, None, strength), atol=1e-4)


def test_metadata_lora_alpha_and_alpha_pattern_are_honoured() -> None:
    net = Net()
    tensors = peft_lora_tensors(net, "transformer", ["blocks.0.q", "blocks.1.ff"], rank=2)
    config = {"transformer.r": 2, "transformer.lora_alpha": 4, "transformer.alpha_pattern": {"blocks.1.ff": 1}}
    weights = convert_peft(tensors, name="m", metadata={PEFT_METADATA_KEY: json.dumps(config)})["transformer"]
    assert weights.low_rank["blocks.0.q"].scale == 2.0  # lora_alpha / r
    assert weights.low_rank["blocks.1.ff"].scale == 0.5  # alpha_pattern / r
    plain = convert_peft(tensors, name="m", metadata={})["transformer"]
    assert plain.low_rank["blocks.0.q"].alpha is None and plain.low_rank["blocks.0.q"].scale == 1.0


@pytest.mark.parametrize("strength", [0.5, 1.0])
def test_a_lora_bias_is_scaled_by_alpha_over_rank_like_peft(strength: float) -> None:
    """PEFT's ``lora_B`` is a Linear holding the bias, so the bias is scaled by α/r with the rest:
    ``b' = b + s·(α/r)·bias``, written out here from the raw file tensors."""
    net = Net()
    tensors = peft_lora_tensors(net, "transformer", ["out"], rank=2, alpha=8.0, bias=True)
    weights = convert_peft(tensors, name="biased", metadata={})
    merged = merge_adapters(net, [(weights["transformer"], strength)])
    got = net.out.bias.detach().clone()
    merged.restore()
    expected = (net.out.bias.double() + strength * 4.0 * tensors["transformer.out.lora_B.bias"].double()).float()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # Negative control: the same check catches a bias left unscaled (PEFT would differ).
    unscaled = (net.out.bias.double() + strength * tensors["transformer.out.lora_B.bias"].double()).float()
    assert not torch.allclose(got, unscaled, atol=1e-4)


def test_bias_components_and_default_suffix() -> None:
    net = Net()
    tensors = peft_lora_tensors(net, "transformer", ["out"], bias=True)
    tensors.update(peft_lora_tensors(net, "text_encoder", ["blocks.0.q"]))
    tensors["text_encoder.blocks.0.q.lora_A.default.weight"] = tensors.pop("text_encoder.blocks.0.q.lora_A.weight")
    weights = convert_peft(tensors, name="two", metadata={})
    assert sorted(weights) == ["text_encoder", "transformer"]
    assert weights["transformer"].low_rank["out"].bias is not None
    assert weights["text_encoder"].component == "text_encoder"


def test_a_key_that_maps_to_nothing_is_named_never_dropped() -> None:
    net = Net()
    tensors = peft_lora_tensors(net, "transformer", ["out"])
    tensors["transformer.out.lora_magnitude_vector"] = torch.ones(3)
    with pytest.raises(AdapterKeyError, match="transformer.out.lora_magnitude_vector"):
        convert_peft(tensors, name="x", metadata={})
    half = peft_lora_tensors(net, "transformer", ["out"])
    del half["transformer.out.lora_B.weight"]
    with pytest.raises(AdapterKeyError, match="transformer.out .needs both"):
        convert_peft(half, name="x", metadata={})


def test_swapped_up_and_down_is_refused_when_checked_against_the_module() -> None:
    net = Net()
    tensors = peft_lora_tensors(net, "transformer", ["blocks.1.ff"], rank=2)
    a, b = tensors["transformer.blocks.1.ff.lora_A.weight"], tensors["transformer.blocks.1.ff.lora_B.weight"]
    tensors["transformer.blocks.1.ff.lora_A.weight"], tensors["transformer.blocks.1.ff.lora_B.weight"] = b.t(), a.t()
    with pytest.raises(AdapterError):
        convert_peft(tensors, name="x", metadata={})["transformer"].check(net)


def test_dora_is_refused_by_name() -> None:
    net = Net()
    tensors = peft_lora_tensors(net, "transformer", ["out"])
    meta = {PEFT_METADATA_KEY: json.dumps({"transformer.use_dora": True})}
    with pytest.raises(AdapterError, match="DoRA"):
        convert_peft(tensors, name="d", metadata=meta)


def test_files_are_read_with_metadata_and_checked(tmp_path: Path) -> None:
    net = Net()
    path = write_peft_lora(tmp_path / "s.safetensors", peft_lora_tensors(net, "transformer", ["out"]), {"fv.assumes_steps": "4"})
    file = read_adapter_file(path)
    assert file.metadata == {"fv.assumes_steps": "4"} and len(file.sha256) == 64
    assert file.size_bytes == path.stat().st_size
    with pytest.raises(AdapterFileError, match="over the limit of 10"):
        read_adapter_file(path, max_bytes=10)
    bad = tmp_path / "s.pt"
    bad.write_bytes(path.read_bytes())
    with pytest.raises(AdapterFileError, match="must be a .safetensors file"):
        read_adapter_file(bad)
    with pytest.raises(AdapterFileError, match="not a safetensors file"):
        read_adapter_bytes(b"\xff" * 64)
    with pytest.raises(AdapterFileError, match="cannot read"):
        read_adapter_file(tmp_path / "missing.safetensors")
