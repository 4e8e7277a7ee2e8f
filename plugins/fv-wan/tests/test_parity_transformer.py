"""C0 parity of fv_wan's WanTransformer against diffusers' WanTransformer3DModel (CPU, fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch.utils.flop_counter import FlopCounterMode

from fv_wan.models.transformer import (
    PRESETS,
    TEXT_CONTEXT_LENGTH,
    WanBlockInputs,
    WanConfigError,
    WanStateDictError,
    WanTransformer,
    WanTransformerConfig,
    cast_for_inference,
    convert_original_state_dict,
    count_forward_flops,
    load_wan_state_dict,
)

FP32_TOLERANCE = 1e-5


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter (zero-initialised ones included) so no term is trivially equal."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)


def _pair(config: WanTransformerConfig, seed: int = 0) -> tuple[WanTransformer3DModel, WanTransformer]:
    reference = WanTransformer3DModel(**config.to_diffusers_config()).eval()
    _randomise(reference, seed)
    ours = WanTransformer(config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    reference.load_state_dict(ours.state_dict(), strict=True)
    return reference, ours


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("cross_attn_norm", [True, False])
def test_t2v_forward_matches_diffusers(cross_attn_norm: bool) -> None:
    config = WanTransformerConfig.tiny().model_copy(update={"cross_attn_norm": cross_attn_norm})
    reference, ours = _pair(config, seed=1)
    generator = torch.Generator().manual_seed(2)
    latents = torch.randn(2, 16, 3, 8, 6, generator=generator)
    timestep = torch.tensor([999.0, 17.5])
    text = torch.randn(2, 10, 32, generator=generator)
    with torch.no_grad():
        expected = reference(latents, timestep, text, return_dict=False)[0]
        actual = ours(latents, timestep, text)
    assert actual.shape == (2, 16, 3, 8, 6)
    assert _max_diff(actual, expected) <= FP32_TOLERANCE


def test_i2v_forward_matches_diffusers_through_image_branch() -> None:
    config = WanTransformerConfig.tiny(image=True, in_channels=36)
    reference, ours = _pair(config, seed=3)
    generator = torch.Generator().manual_seed(4)
    latents = torch.randn(1, 36, 2, 4, 6, generator=generator)
    text = torch.randn(1, TEXT_CONTEXT_LENGTH, 32, generator=generator)
    image = torch.randn(1, 5, 16, generator=generator)
    timestep = torch.tensor([400.0])
    with torch.no_grad():
        expected = reference(latents, timestep, text, image, return_dict=False)[0]
        actual = ours(latents, timestep, text, image)
        without_image = reference(latents, timestep, text, return_dict=False)[0]
        inputs = ours.prepare(latents, timestep, text, image)
    assert inputs.context_image is not None and inputs.context_image.shape[1] == 5
    assert inputs.context.shape[1] == TEXT_CONTEXT_LENGTH
    assert _max_diff(actual, expected) <= FP32_TOLERANCE
    # The image tokens really changed the output (the added K/V branch ran).
    assert _max_diff(expected, without_image) > 1e-3


def test_flf2v_image_position_table_matches_diffusers() -> None:
    config = WanTransformerConfig.tiny(image=True, in_channels=36).model_copy(update={"pos_embed_seq_len": 10})
    reference, ours = _pair(config, seed=5)
    generator = torch.Generator().manual_seed(6)
    latents = torch.randn(1, 36, 2, 4, 4, generator=generator)
    text = torch.randn(1, TEXT_CONTEXT_LENGTH, 32, generator=generator)
    first_and_last = torch.randn(2, 5, 16, generator=generator)  # stacked into 10 tokens of one sample
    with torch.no_grad():
        expected = reference(latents, torch.tensor([250.0]), text, first_and_last, return_dict=False)[0]
        actual = ours(latents, torch.tensor([250.0]), text, first_and_last)
    assert _max_diff(actual, expected) <= FP32_TOLERANCE


def test_image_tokens_joining_text_context_without_added_kv() -> None:
    # diffusers' own tiny I2V test config: image_dim set, no added K/V -> image tokens join the text context.
    config = WanTransformerConfig.tiny(in_channels=36).model_copy(update={"image_dim": 4})
    reference, ours = _pair(config, seed=7)
    generator = torch.Generator().manual_seed(8)
    latents = torch.randn(1, 36, 1, 4, 4, generator=generator)
    text, image = torch.randn(1, 16, 32, generator=generator), torch.randn(1, 3, 4, generator=generator)
    with torch.no_grad():
        expected = reference(latents, torch.tensor([10.0]), text, image, return_dict=False)[0]
        actual = ours(latents, torch.tensor([10.0]), text, image)
    assert _max_diff(actual, expected) <= FP32_TOLERANCE


def test_ti2v_per_token_timesteps_match_diffusers() -> None:
    config = WanTransformerConfig.tiny(in_channels=48, out_channels=48)
    reference, ours = _pair(config, seed=9)
    generator = torch.Generator().manual_seed(10)
    latents = torch.randn(2, 48, 3, 4, 6, generator=generator)
    text = torch.randn(2, 12, 32, generator=generator)
    # WanPipeline(expand_timesteps=True): first latent frame is the clean condition (t = 0).
    mask = torch.ones(1, 1, 3, 4, 6)
    mask[:, :, 0] = 0
    per_token = (mask[0][0][:, ::2, ::2] * 731.0).flatten().unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        expected = reference(latents, per_token, text, return_dict=False)[0]
        actual = ours(latents, per_token, text)
        inputs = ours.prepare(latents, per_token, text)
    assert inputs.timestep_proj.shape == (2, 3 * 2 * 3, 6, config.inner_dim)
    assert _max_diff(actual, expected) <= FP32_TOLERANCE


def test_block_runner_equals_default_loop_and_is_used() -> None:
    config = WanTransformerConfig.tiny()
    _, model = _pair(config, seed=11)
    generator = torch.Generator().manual_seed(12)
    latents, text = torch.randn(1, 16, 2, 4, 4, generator=generator), torch.randn(1, 8, 32, generator=generator)
    timestep = torch.tensor([500.0])
    calls: list[int] = []

    def runner(module: WanTransformer, x: torch.Tensor, inputs: WanBlockInputs) -> torch.Tensor:
        for index in range(module.num_layers):
            calls.append(index)
            x = module.run_block(index, x, inputs)
        return x

    def skip_last(module: WanTransformer, x: torch.Tensor, inputs: WanBlockInputs) -> torch.Tensor:
        return module.run_block(0, x, inputs)

    with torch.no_grad():
        default = model(latents, timestep, text)
        via_runner = model(latents, timestep, text, block_runner=runner)
        skipped = model(latents, timestep, text, block_runner=skip_last)
        inputs = model.prepare(latents, timestep, text)
        manual = model.finish(model.run_block(1, model.run_block(0, inputs.x, inputs), inputs), inputs)
    assert calls == [0, 1]
    assert torch.equal(default, via_runner) and torch.equal(default, manual)
    assert _max_diff(default, skipped) > 1e-3


def test_attention_fn_is_swappable() -> None:
    config = WanTransformerConfig.tiny()
    _, model = _pair(config, seed=13)
    shapes: list[tuple[int, ...]] = []

    def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(q.shape))
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        return scores.softmax(-1) @ v

    generator = torch.Generator().manual_seed(14)
    latents, text = torch.randn(1, 16, 2, 4, 4, generator=generator), torch.randn(1, 8, 32, generator=generator)
    with torch.no_grad():
        default = model(latents, torch.tensor([300.0]), text)
        model.set_attention_fn(explicit_attention)
        swapped = model(latents, torch.tensor([300.0]), text)
    assert shapes and shapes[0] == (1, 2, 8, 12)  # (B, heads, L, head_dim)
    assert _max_diff(default, swapped) <= 1e-4
    with pytest.raises(TypeError, match="callable"):
        model.set_attention_fn("sdpa")  # type: ignore[arg-type]


def _original_layout(config: WanTransformerConfig, seed: int) -> dict[str, torch.Tensor]:
    """A synthetic checkpoint with the key names of the original Wan release (wan/modules/model.py)."""
    generator = torch.Generator().manual_seed(seed)
    dim, ffn, patch = config.inner_dim, config.ffn_dim, config.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (dim, config.in_channels, *patch),
        "patch_embedding.bias": (dim,),
        "text_embedding.0.weight": (dim, config.text_dim), "text_embedding.0.bias": (dim,),
        "text_embedding.2.weight": (dim, dim), "text_embedding.2.bias": (dim,),
        "time_embedding.0.weight": (dim, config.freq_dim), "time_embedding.0.bias": (dim,),
        "time_embedding.2.weight": (dim, dim), "time_embedding.2.bias": (dim,),
        "time_projection.1.weight": (6 * dim, dim), "time_projection.1.bias": (6 * dim,),
        "head.head.weight": (config.out_channels * 4, dim), "head.head.bias": (config.out_channels * 4,),
        "head.modulation": (1, 2, dim),
        "img_emb.proj.0.weight": (config.image_dim,), "img_emb.proj.0.bias": (config.image_dim,),
        "img_emb.proj.1.weight": (config.image_dim, config.image_dim), "img_emb.proj.1.bias": (config.image_dim,),
        "img_emb.proj.3.weight": (dim, config.image_dim), "img_emb.proj.3.bias": (dim,),
        "img_emb.proj.4.weight": (dim,), "img_emb.proj.4.bias": (dim,),
    }  # fmt: skip
    for i in range(config.num_layers):
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                shapes[f"blocks.{i}.{attn}.{proj}.weight"] = (dim, dim)
                shapes[f"blocks.{i}.{attn}.{proj}.bias"] = (dim,)
            shapes[f"blocks.{i}.{attn}.norm_q.weight"] = (dim,)
            shapes[f"blocks.{i}.{attn}.norm_k.weight"] = (dim,)
        for proj in ("k_img", "v_img"):
            shapes[f"blocks.{i}.cross_attn.{proj}.weight"] = (dim, dim)
            shapes[f"blocks.{i}.cross_attn.{proj}.bias"] = (dim,)
        shapes[f"blocks.{i}.cross_attn.norm_k_img.weight"] = (dim,)
        shapes[f"blocks.{i}.norm3.weight"] = (dim,)  # the original's cross-attention norm
        shapes[f"blocks.{i}.norm3.bias"] = (dim,)
        shapes[f"blocks.{i}.ffn.0.weight"], shapes[f"blocks.{i}.ffn.0.bias"] = (ffn, dim), (ffn,)
        shapes[f"blocks.{i}.ffn.2.weight"], shapes[f"blocks.{i}.ffn.2.bias"] = (dim, ffn), (dim,)
        shapes[f"blocks.{i}.modulation"] = (1, 6, dim)
    return {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}


def test_convert_original_state_dict_round_trip() -> None:
    config = WanTransformerConfig.tiny(image=True, in_channels=36)
    original = _original_layout(config, seed=15)
    converted = convert_original_state_dict(original)
    model = WanTransformer(config)
    model.load_state_dict(converted, strict=True)  # every key mapped, every model key covered, shapes fit
    reference = WanTransformer3DModel(**config.to_diffusers_config())
    reference.load_state_dict(converted, strict=True)
    assert torch.equal(model.blocks[1].attn1.to_out[0].weight, original["blocks.1.self_attn.o.weight"])
    assert torch.equal(model.blocks[0].norm2.weight, original["blocks.0.norm3.weight"])
    assert torch.equal(model.blocks[0].attn2.add_k_proj.weight, original["blocks.0.cross_attn.k_img.weight"])
    assert torch.equal(model.scale_shift_table, original["head.modulation"])
    assert torch.equal(model.blocks[1].scale_shift_table, original["blocks.1.modulation"])
    # Old diffusers checkpoints carry unused norm_added_q weights, which diffusers ignores on load.
    load_wan_state_dict(model, {**converted, "blocks.0.attn2.norm_added_q.weight": torch.ones(24)})
    with pytest.raises(WanStateDictError, match=r"missing \['proj_out.bias'\]"):
        load_wan_state_dict(model, {k: v for k, v in converted.items() if k != "proj_out.bias"})
    # A wrapper prefix is stripped; an unknown key is reported by name.
    prefixed = convert_original_state_dict({f"model.diffusion_model.{k}": v for k, v in original.items()})
    assert prefixed.keys() == converted.keys()
    with pytest.raises(WanStateDictError, match=r"blocks\.0\.self_attn\.mystery\.weight"):
        convert_original_state_dict({**original, "blocks.0.self_attn.mystery.weight": torch.zeros(1)})


def test_config_from_diffusers_and_rejection_of_unknown_keys() -> None:
    raw = {
        "_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0.dev0",
        "added_kv_proj_dim": None, "attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-06,
        "ffn_dim": 8960, "freq_dim": 256, "image_dim": None, "in_channels": 16, "num_attention_heads": 12,
        "num_layers": 30, "out_channels": 16, "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 1024, "text_dim": 4096,
    }  # fmt: skip
    assert WanTransformerConfig.from_diffusers_config(raw) == WanTransformerConfig.wan21_t2v_1_3b()
    with pytest.raises(WanConfigError, match=r"window_size"):
        WanTransformerConfig.from_diffusers_config({**raw, "window_size": [-1, -1]})
    with pytest.raises(ValueError, match="qk_norm"):
        WanTransformerConfig.from_diffusers_config({**raw, "qk_norm": "layer_norm"})
    with pytest.raises(ValueError, match="added_kv_proj_dim"):
        WanTransformerConfig(added_kv_proj_dim=1280, image_dim=1280)
    with pytest.raises(WanConfigError, match="unknown Wan transformer preset"):
        WanTransformerConfig.preset("wan9")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_state_dict_layout_matches_diffusers(name: str) -> None:
    config = WanTransformerConfig.preset(name)
    with torch.device("meta"):
        reference = WanTransformer3DModel(**config.to_diffusers_config())
        ours = WanTransformer(config)
    expected = {key: tuple(value.shape) for key, value in reference.state_dict().items()}
    assert {key: tuple(value.shape) for key, value in ours.state_dict().items()} == expected


def test_from_pretrained_loads_diffusers_checkpoint_with_fp32_modules(tmp_path) -> None:
    config = WanTransformerConfig.tiny()
    reference, _ = _pair(config, seed=16)
    reference.save_pretrained(tmp_path / "transformer")
    assert json.loads((tmp_path / "transformer" / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    # diffusers' from_pretrained needs accelerate (absent here); apply its keep-in-fp32 rule
    # (model_loading_utils: any name component in _keep_in_fp32_modules) to the in-memory reference.
    loaded_ref = reference
    for name, parameter in loaded_ref.named_parameters():
        keep = any(m in name.split(".") for m in WanTransformer3DModel._keep_in_fp32_modules)
        parameter.data = parameter.data.to(torch.float32 if keep else torch.bfloat16)
    model = WanTransformer.from_pretrained(tmp_path, subfolder="transformer", dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes == {name: p.dtype for name, p in loaded_ref.named_parameters()}
    assert dtypes["blocks.0.scale_shift_table"] == torch.float32
    assert dtypes["condition_embedder.time_embedder.linear_1.weight"] == torch.float32
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    generator = torch.Generator().manual_seed(17)
    latents = torch.randn(1, 16, 2, 4, 4, generator=generator).bfloat16()
    text = torch.randn(1, 8, 32, generator=generator).bfloat16()
    with torch.no_grad():
        expected = loaded_ref(latents, torch.tensor([600.0]), text, return_dict=False)[0]
        actual = model(latents, torch.tensor([600.0]), text)
    assert actual.dtype == torch.bfloat16
    # Same op sequence and dtypes as diffusers, so bf16 matches bitwise on CPU.
    assert torch.equal(actual, expected)


def test_cast_for_inference_keeps_listed_modules_fp32() -> None:
    model = cast_for_inference(WanTransformer(WanTransformerConfig.tiny(image=True, in_channels=36)), torch.float16)
    for name, parameter in model.named_parameters():
        kept = bool({"time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"} & set(name.split(".")))
        assert parameter.dtype == (torch.float32 if kept else torch.float16), name
    assert model.rope.cos_table.dtype == torch.float32


@pytest.mark.parametrize("per_token", [False, True])
def test_count_forward_flops_matches_flop_counter(per_token: bool) -> None:
    config = WanTransformerConfig.tiny(image=True, in_channels=36)
    model = WanTransformer(config, attention_fn=lambda q, k, v: (q @ k.transpose(-1, -2)).softmax(-1) @ v).eval()
    latents, text, image = torch.randn(1, 36, 2, 4, 4), torch.randn(1, TEXT_CONTEXT_LENGTH, 32), torch.randn(1, 5, 16)
    timestep = torch.full((1, 8), 5.0) if per_token else torch.tensor([5.0])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(latents, timestep, text, image)
    expected = count_forward_flops(config, 8, TEXT_CONTEXT_LENGTH, image_tokens=5, per_token_timesteps=per_token)
    assert counter.get_total_flops() == expected


def test_bad_inputs_raise_clear_errors() -> None:
    config = WanTransformerConfig.tiny(image=True, in_channels=36)
    model = WanTransformer(config)
    latents = torch.randn(1, 36, 1, 4, 4)
    with pytest.raises(ValueError, match=r"exactly 512 text tokens"):
        model.prepare(latents, torch.tensor([1.0]), torch.randn(1, 16, 32), torch.randn(1, 5, 16))
    with pytest.raises(ValueError, match=r"per-token"):
        model.prepare(latents, torch.ones(1, 3), torch.randn(1, 16, 32))
    with pytest.raises(ValueError, match=r"divisible"):
        model.prepare(torch.randn(1, 36, 1, 3, 4), torch.tensor([1.0]), torch.randn(1, 16, 32))
    with pytest.raises(ValueError, match=r"no image embedder"):
        WanTransformer(WanTransformerConfig.tiny()).prepare(
            torch.randn(1, 16, 1, 4, 4), torch.tensor([1.0]), torch.randn(1, 16, 32), torch.randn(1, 5, 16)
        )
