"""LoRA parity: fv_wan's converter + the kernel's per-row and merged application against
diffusers' own ``WanPipeline.load_lora_weights`` + ``set_adapters`` (PEFT), fp32 on CPU.

Each test writes a tiny random transformer and a LoRA .safetensors file in one of the formats
in the wild; diffusers reads the same file with its own converters. The module tables below
are written out here, not taken from fv_wan, so the reference shares nothing with the code
under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from fv_wan.lora import convert_wan_lora
from fv_wan.models.transformer import WanTransformer, WanTransformerConfig
from safetensors import safe_open
from safetensors.torch import save_file

from fv_kernel.api import AdapterError, RowAdapters, merge_adapters, rows_adapted
from fv_kernel.compute import lora as kernel_lora

TOLERANCE = 1e-5
RANK = 4

#: original Wan name -> diffusers name, per block (lora.md §2; written out independently).
BLOCK_LINEARS = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v", "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0",
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}  # fmt: skip
TOP_LINEARS = {"head.head": "proj_out", "time_projection.1": "condition_embedder.time_proj"}


def _randomise(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            # small weights keep the outputs near 1, where 1e-5 is a relative fp32 bound too
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def _models(seed: int = 0) -> tuple[WanTransformer3DModel, WanTransformer]:
    config = WanTransformerConfig.tiny()
    reference = WanTransformer3DModel(**config.to_diffusers_config()).eval()
    _randomise(reference, seed)
    ours = WanTransformer(config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return (
        torch.randn(2, 16, 3, 8, 6, generator=generator),
        torch.tensor([999.0, 17.5]),
        torch.randn(2, 10, 32, generator=generator),
    )


def _shape(model: torch.nn.Module, path: str) -> tuple[int, int]:
    out_features, in_features = model.get_submodule(path).weight.shape
    return int(out_features), int(in_features)


def _lora(generator: torch.Generator, out_features: int, in_features: int, rank: int = RANK) -> tuple[torch.Tensor, torch.Tensor]:
    down = torch.randn(rank, in_features, generator=generator) * 0.2
    up = torch.randn(out_features, rank, generator=generator) * 0.2
    return down, up


def _modules(reference: torch.nn.Module) -> dict[str, str]:
    """Every LoRA target, original name -> diffusers name."""
    out = {f"blocks.{i}.{o}": f"blocks.{i}.{d}" for i in range(2) for o, d in BLOCK_LINEARS.items()}
    out.update(TOP_LINEARS)
    return out


def write_lora(
    folder: Path, reference: torch.nn.Module, fmt: str, *, seed: int = 11, square_only: bool = False, transpose: bool = False
) -> Path:
    """A LoRA file in ``fmt``; ``square_only``: square modules only; ``transpose``: down/up written as up.T/down.T."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {"format": "pt"}
    modules = _modules(reference)
    if square_only:
        modules = {o: d for o, d in modules.items() if _shape(reference, d)[0] == _shape(reference, d)[1]}
    for index, (original, diffusers_name) in enumerate(sorted(modules.items())):
        down, up = _lora(generator, *_shape(reference, diffusers_name))
        if transpose:
            down, up = up.t().contiguous(), down.t().contiguous()
        blocky = original.startswith("blocks.")
        if fmt in ("diffusers", "diffusers_metadata"):
            tensors[f"transformer.{diffusers_name}.lora_A.weight"] = down
            tensors[f"transformer.{diffusers_name}.lora_B.weight"] = up
            if index % 3 == 0:
                tensors[f"transformer.{diffusers_name}.lora_B.bias"] = torch.randn(up.shape[0], generator=generator) * 0.1
        elif fmt in ("original", "original_AB"):
            down_key, up_key = ("lora_A", "lora_B") if fmt == "original_AB" else ("lora_down", "lora_up")
            tensors[f"diffusion_model.{original}.{down_key}.weight"] = down
            tensors[f"diffusion_model.{original}.{up_key}.weight"] = up
            # diffusers' converter folds alpha only on block modules (it leaves a top-level one unread).
            if blocky:
                tensors[f"diffusion_model.{original}.alpha"] = torch.tensor(1.0 if index % 2 else 6.0)
            if index % 3 == 0 or not blocky:
                tensors[f"diffusion_model.{original}.diff_b"] = torch.randn(up.shape[0], generator=generator) * 0.1
        elif fmt in ("kohya", "wan_fun"):
            if not blocky:
                continue  # diffusers' Musubi converter reads blocks only
            prefix = "lora_unet__" if fmt == "wan_fun" else "lora_unet_"
            stem = prefix + original.replace(".", "_")
            tensors[f"{stem}.lora_down.weight"] = down
            tensors[f"{stem}.lora_up.weight"] = up
            tensors[f"{stem}.alpha"] = torch.tensor(1.0 if index % 2 else 6.0)
        else:
            raise AssertionError(fmt)
    if fmt == "diffusers_metadata":
        targets = sorted({k.split(".", 1)[1].rsplit(".lora_", 1)[0] for k in tensors})
        metadata["lora_adapter_metadata"] = json.dumps({
            "transformer.r": RANK, "transformer.lora_alpha": 2, "transformer.target_modules": targets,
            "transformer.lora_bias": True, "transformer.alpha_pattern": {"proj_out": 12},
        })  # fmt: skip
    path = folder / f"{fmt}.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    return path


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
        return tensors, dict(handle.metadata() or {})


def _fv_output(ours: WanTransformer, path: Path, strength: float, mode: str, name: str = "lora") -> torch.Tensor:
    state_dict, metadata = _read(path)
    adapter = convert_wan_lora(state_dict, name=name, metadata=metadata)["transformer"]
    latents, timestep, text = _inputs()
    with torch.no_grad():
        if mode == "rows":
            routing = RowAdapters.from_stacks([[(adapter, strength)]] * latents.shape[0])
            with rows_adapted(ours, routing):
                return ours(latents, timestep, text)
        merged = merge_adapters(ours, [(adapter, strength)])
        try:
            return ours(latents, timestep, text)
        finally:
            merged.restore()


def _diffusers_output(reference: WanTransformer3DModel, path: Path, strength: float) -> torch.Tensor:
    state_dict, metadata = _read(path)
    if any(k.startswith("lora_unet__") for k in state_dict):
        # diffusers has no Wan-Fun rule; ComfyUI's (lora_convert.py) rewrites the prefix to Musubi's
        path = path.with_name(path.stem + "_as_musubi.safetensors")
        save_file({"lora_unet_" + k[len("lora_unet__"):]: v for k, v in state_dict.items()}, str(path), metadata=metadata)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=reference, vae=None, scheduler=None)
    # low_cpu_mem_usage=False: PEFT then zero-initialises the lora_B.bias of modules the file gives
    # none (with the default, they stay on the meta device and the forward fails).
    pipe.load_lora_weights(str(path), adapter_name="lora", low_cpu_mem_usage=False)
    pipe.set_adapters(["lora"], [strength])
    latents, timestep, text = _inputs()
    with torch.no_grad():
        return reference(latents, timestep, text, return_dict=False)[0]


FORMATS = ["diffusers", "diffusers_metadata", "original", "original_AB", "kohya", "wan_fun"]


@pytest.mark.parametrize("mode", ["rows", "merged"])
@pytest.mark.parametrize("strength", [0.5, 1.0])
@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_matches_diffusers_load_lora_weights(tmp_path: Path, fmt: str, strength: float, mode: str) -> None:
    reference, ours = _models()
    path = write_lora(tmp_path, reference, fmt)
    with torch.no_grad():
        base = ours(*_inputs())
    expected = _diffusers_output(reference, path, strength)
    actual = _fv_output(ours, path, strength, mode)
    assert (expected - base).abs().max() > 1e-2, "the LoRA must change the output for the test to mean anything"
    assert (actual - expected).abs().max() <= TOLERANCE


def test_rows_with_different_strengths_match_diffusers_per_strength(tmp_path: Path) -> None:
    """One batched forward, row 0 at 0.5 and row 1 at 1.0 (the case diffusers cannot batch)."""
    reference, ours = _models()
    path = write_lora(tmp_path, reference, "original")
    state_dict, metadata = _read(path)
    adapter = convert_wan_lora(state_dict, name="lora", metadata=metadata)["transformer"]
    latents, timestep, text = _inputs()
    with torch.no_grad(), rows_adapted(ours, RowAdapters.from_stacks([[(adapter, 0.5)], [(adapter, 1.0)]])):
        actual = ours(latents, timestep, text)
    half = _diffusers_output(reference, path, 0.5)
    reference.set_adapters(["lora"], [1.0])
    with torch.no_grad():
        full = reference(latents, timestep, text, return_dict=False)[0]
    assert (actual[0] - half[0]).abs().max() <= TOLERANCE
    assert (actual[1] - full[1]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("mode", ["rows", "merged"])
def test_negative_control_transposed_up_down_fails_parity(tmp_path: Path, mode: str) -> None:
    """Square modules: a file with down/up transposed loads but must not match the correct file."""
    reference, ours = _models()
    (tmp_path / "wrong").mkdir()
    correct = write_lora(tmp_path, reference, "original", square_only=True)
    wrong = write_lora(tmp_path / "wrong", reference, "original", square_only=True, transpose=True)
    expected = _diffusers_output(reference, correct, 1.0)
    assert (_fv_output(ours, correct, 1.0, mode) - expected).abs().max() <= TOLERANCE  # the control is fair
    assert (_fv_output(ours, wrong, 1.0, mode) - expected).abs().max() > 1e-3


def test_negative_control_swapped_up_down_on_a_non_square_module_is_refused() -> None:
    generator = torch.Generator().manual_seed(3)
    down, up = _lora(generator, 32, 24)  # ffn.0: 24 -> 32
    state_dict = {
        "diffusion_model.blocks.0.ffn.0.lora_down.weight": up.t().contiguous(),
        "diffusion_model.blocks.0.ffn.0.lora_up.weight": down.t().contiguous(),
    }
    _, ours = _models()
    adapter = convert_wan_lora(state_dict, name="swapped", metadata={})["transformer"]
    with pytest.raises(AdapterError, match="swapped"):
        adapter.check(ours)
    swapped_roles = {
        "diffusion_model.blocks.0.ffn.0.lora_down.weight": up,
        "diffusion_model.blocks.0.ffn.0.lora_up.weight": down,
    }
    with pytest.raises(AdapterError, match="up must be"):
        convert_wan_lora(swapped_roles, name="swapped", metadata={})


@pytest.mark.parametrize("mode", ["rows", "merged"])
@pytest.mark.parametrize("fmt", ["original", "kohya", "diffusers_metadata"])
def test_negative_control_alpha_ignored_fails_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, mode: str
) -> None:
    reference, ours = _models()
    path = write_lora(tmp_path, reference, fmt)
    expected = _diffusers_output(reference, path, 1.0)
    assert (_fv_output(ours, path, 1.0, mode) - expected).abs().max() <= TOLERANCE
    monkeypatch.setattr(kernel_lora.LowRankUpdate, "scale", property(lambda self: 1.0))
    assert (_fv_output(ours, path, 1.0, mode) - expected).abs().max() > 1e-3


def test_wan22_file_for_the_low_noise_expert_matches_load_into_transformer_2(tmp_path: Path) -> None:
    """A file named ``*.transformer_2`` adapts ``transformer_2`` only, as
    ``load_lora_weights(..., load_into_transformer_2=True)``; the high-noise expert is untouched."""
    reference, ours = _models(seed=0)
    reference_2, ours_2 = _models(seed=5)
    path = write_lora(tmp_path, reference_2, "original")
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, transformer=reference, vae=None, scheduler=None, transformer_2=reference_2
    )
    pipe.load_lora_weights(str(path), adapter_name="low", load_into_transformer_2=True, low_cpu_mem_usage=False)
    pipe.set_adapters(["low"], [0.5])
    state_dict, metadata = _read(path)
    converted = convert_wan_lora(state_dict, name="lightx2v_low.transformer_2", metadata=metadata)
    assert set(converted) == {"transformer_2"}
    by_metadata = convert_wan_lora(state_dict, name="low", metadata={**metadata, "fv_component": "transformer_2"})
    assert set(by_metadata) == {"transformer_2"} and by_metadata["transformer_2"].version == converted["transformer_2"].version
    latents, timestep, text = _inputs()
    with torch.no_grad():
        expected_2 = reference_2(latents, timestep, text, return_dict=False)[0]
        expected_1 = reference(latents, timestep, text, return_dict=False)[0]
        with rows_adapted(ours_2, RowAdapters.from_stacks([[(converted["transformer_2"], 0.5)]] * 2)):
            actual_2 = ours_2(latents, timestep, text)
        actual_1 = ours(latents, timestep, text)
    assert (actual_2 - expected_2).abs().max() <= TOLERANCE
    assert (actual_1 - expected_1).abs().max() <= TOLERANCE


def _full_delta_reference(reference: WanTransformer3DModel, deltas: dict[str, torch.Tensor], strength: float) -> None:
    """ComfyUI's rule, written here: P += strength · ΔP on the diffusers model's own parameters."""
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, delta in deltas.items():
            params[name].add_(delta * strength)


@pytest.mark.parametrize("strength", [0.5, 1.0])
def test_full_deltas_diff_diff_b_modulation_and_norms(tmp_path: Path, strength: float) -> None:
    """LightX2V/CausVid-style ``.diff`` / ``.diff_b`` entries (which diffusers skips for blocks) against
    the parameter update written out by hand; a non-zero norm delta and a modulation delta apply
    merged and are refused per row; an all-zero norm delta is dropped."""
    reference, ours = _models()
    generator = torch.Generator().manual_seed(4)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.1

    file = {
        "diffusion_model.blocks.0.self_attn.q.diff": rand(24, 24),
        "diffusion_model.blocks.0.self_attn.q.diff_b": rand(24),
        "diffusion_model.blocks.1.ffn.2.diff": rand(24, 32),
        "diffusion_model.head.head.diff": rand(64, 24),
        "diffusion_model.blocks.0.modulation.diff": rand(1, 6, 24),
        "diffusion_model.blocks.1.cross_attn.norm_k.diff": rand(24),
        "diffusion_model.blocks.0.self_attn.norm_q.diff": torch.zeros(24),
        "diffusion_model.blocks.1.norm3.diff_b": torch.zeros(24),
    }
    by_hand = {
        "blocks.0.attn1.to_q.weight": file["diffusion_model.blocks.0.self_attn.q.diff"],
        "blocks.0.attn1.to_q.bias": file["diffusion_model.blocks.0.self_attn.q.diff_b"],
        "blocks.1.ffn.net.2.weight": file["diffusion_model.blocks.1.ffn.2.diff"],
        "proj_out.weight": file["diffusion_model.head.head.diff"],
        "blocks.0.scale_shift_table": file["diffusion_model.blocks.0.modulation.diff"],
        "blocks.1.attn2.norm_k.weight": file["diffusion_model.blocks.1.cross_attn.norm_k.diff"],
    }
    adapter = convert_wan_lora(file, name="distill", metadata={})["transformer"]
    assert set(adapter.deltas) == set(by_hand)  # the all-zero norm deltas are dropped
    assert adapter.merge_only_params(ours) == ["blocks.0.scale_shift_table", "blocks.1.attn2.norm_k.weight"]
    _full_delta_reference(reference, by_hand, strength)
    latents, timestep, text = _inputs()
    with torch.no_grad():
        expected = reference(latents, timestep, text, return_dict=False)[0]
        merged = merge_adapters(ours, [(adapter, strength)])
        actual = ours(latents, timestep, text)
        merged.restore()
        routing = RowAdapters.from_stacks([[(adapter, strength)]] * 2)
        with pytest.raises(AdapterError, match="merged only"), rows_adapted(ours, routing):
            ours(latents, timestep, text)
    assert (actual - expected).abs().max() <= TOLERANCE
    # the linear-only deltas apply per row too
    linear_only = {k: v for k, v in file.items() if "modulation" not in k and "norm" not in k}
    per_row = convert_wan_lora(linear_only, name="distill-linears", metadata={})["transformer"]
    reference_2, ours_2 = _models()
    _full_delta_reference(reference_2, {k: v for k, v in by_hand.items() if "scale_shift" not in k and "norm" not in k}, strength)
    with torch.no_grad(), rows_adapted(ours_2, RowAdapters.from_stacks([[(per_row, strength)]] * 2)):
        actual_rows = ours_2(latents, timestep, text)
        expected_rows = reference_2(latents, timestep, text, return_dict=False)[0]
    assert (actual_rows - expected_rows).abs().max() <= TOLERANCE


def test_lightx2v_head_diff_matches_diffusers(tmp_path: Path) -> None:
    """``head.head.diff`` + ``diff_b`` (LightX2V Wan2.2 distill): diffusers loads it as a LoRA with an identity up."""
    reference, ours = _models()
    generator = torch.Generator().manual_seed(9)
    tensors = {
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.randn(RANK, 24, generator=generator) * 0.2,
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.randn(24, RANK, generator=generator) * 0.2,
        "diffusion_model.head.head.diff": torch.randn(64, 24, generator=generator) * 0.1,
        "diffusion_model.head.head.diff_b": torch.randn(64, generator=generator) * 0.1,
    }
    path = tmp_path / "lightx2v.safetensors"
    save_file(tensors, str(path))
    expected = _diffusers_output(reference, path, 0.5)
    for mode in ("rows", "merged"):
        assert (_fv_output(ours, path, 0.5, mode) - expected).abs().max() <= TOLERANCE
