"""Key maps (unified/diffusers <-> transformers reasoner) and config validation."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fv_cosmos3.models import (
    Cosmos3Config,
    Cosmos3MoT,
    UnmappedKeysError,
    from_unified_state_dict,
    to_transformers_reasoner_state_dict,
)
from fv_cosmos3.models.state_dict import is_reasoner_key

diffusers = pytest.importorskip("diffusers")


def test_state_dict_layout_is_diffusers_layout(tiny_config):
    ours = Cosmos3MoT(tiny_config).state_dict()
    theirs = diffusers.Cosmos3OmniTransformer(**tiny_config.to_diffusers_kwargs()).state_dict()
    assert set(ours) == set(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in ours)


def test_edge_state_dict_layout_is_diffusers_layout():
    config = Cosmos3Config.tiny(hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True)
    ours = Cosmos3MoT(config).state_dict()
    theirs = diffusers.Cosmos3OmniTransformer(**config.to_diffusers_kwargs()).state_dict()
    assert set(ours) == set(theirs)
    assert "layers.0.self_attn.k_norm_und_for_gen.weight" in ours
    with pytest.raises(ValueError, match="relu2"):
        to_transformers_reasoner_state_dict(ours)


def test_transformers_round_trip(tiny_model):
    _, state = tiny_model
    reasoner = to_transformers_reasoner_state_dict(state)
    assert "lm_head.weight" in reasoner
    assert "model.language_model.layers.2.self_attn.q_proj.weight" in reasoner
    assert "model.language_model.layers.0.self_attn.k_norm.weight" in reasoner
    assert not any("moe_gen" in k or "add_" in k or "proj_in" in k for k in reasoner)
    back = from_unified_state_dict(reasoner)
    expected_reasoner = {k for k in state if is_reasoner_key(k)}
    assert len(expected_reasoner) == 3 + 3 * 11  # embed/norm/lm_head + per layer: 4 attn, 2 qk-norm, 3 mlp, 2 norms
    assert set(back) == expected_reasoner
    assert all(torch.equal(back[k], state[k]) for k in back)
    generator_part = {k: v for k, v in state.items() if k not in back}
    merged = from_unified_state_dict({**reasoner, **generator_part, "model.visual.blocks.0.attn.qkv.weight": torch.zeros(1)})
    assert set(merged) == set(state)
    Cosmos3MoT(Cosmos3Config.tiny()).load_state_dict(merged, strict=True)


def test_unified_identity_and_flat_qwen_names(tiny_model):
    _, state = tiny_model
    assert from_unified_state_dict(state).keys() == state.keys()
    flat_qwen = {k.replace(".self_attn.to_q.", ".self_attn.q_proj.").replace(".self_attn.norm_k.", ".self_attn.k_norm."): v for k, v in state.items()}
    assert from_unified_state_dict(flat_qwen).keys() == state.keys()


def test_unmapped_keys_raise_with_list(tiny_model):
    _, state = tiny_model
    bad = {**state, "layers.0.self_attn.mystery.weight": torch.zeros(1), "vae.encoder.weight": torch.zeros(1)}
    with pytest.raises(UnmappedKeysError) as err:
        from_unified_state_dict(bad)
    assert err.value.keys == ["layers.0.self_attn.mystery.weight", "vae.encoder.weight"]
    with pytest.raises(UnmappedKeysError, match="mystery"):
        to_transformers_reasoner_state_dict(bad)
    with pytest.raises(UnmappedKeysError, match="blocks.0"):
        from_unified_state_dict({**state, "blocks.0.attn.qkv.weight": torch.zeros(1)}, drop_vision_tower=False)
    with pytest.raises(ValueError, match="two source keys"):
        from_unified_state_dict({**state, "model.language_model.norm.weight": state["norm.weight"]})


def test_config_from_diffusers_config_round_trip(tiny_config):
    model = diffusers.Cosmos3OmniTransformer(**tiny_config.to_diffusers_kwargs())
    raw = dict(model.config)
    assert any(k.startswith("_") for k in raw)  # diffusers metadata is present and must be tolerated
    assert Cosmos3Config.from_diffusers_config(raw) == tiny_config
    legacy = {k: v for k, v in raw.items() if k != "rope_axes_dim"} | {"rope_scaling": {"mrope_section": [4, 2, 2]}}
    assert Cosmos3Config.from_diffusers_config(legacy).rope_axes_dim == (4, 2, 2)


def test_config_rejects_unknown_and_inconsistent_fields():
    with pytest.raises(ValidationError, match="not_a_field"):
        Cosmos3Config.from_diffusers_config({"not_a_field": 1})
    with pytest.raises(ValidationError, match="extra"):
        Cosmos3Config(hidden_sizee=8)
    with pytest.raises(ValidationError, match="hidden_act"):
        Cosmos3Config.tiny(hidden_act="gelu")
    with pytest.raises(ValidationError, match="rope_axes_dim"):
        Cosmos3Config.tiny(rope_axes_dim=(4, 4, 4))
    with pytest.raises(ValidationError, match="num_key_value_heads"):
        Cosmos3Config.tiny(num_key_value_heads=3)
    with pytest.raises(ValidationError, match="patch_latent_dim"):
        Cosmos3Config.tiny(patch_latent_dim=192)
    with pytest.raises(ValidationError, match="sound_dim"):
        Cosmos3Config.tiny(sound_dim=None)


def test_presets_have_reference_sizes():
    nano, big = Cosmos3Config.nano(), Cosmos3Config.super_()
    assert (nano.hidden_size, nano.num_hidden_layers, nano.num_attention_heads, nano.num_key_value_heads) == (4096, 36, 32, 8)
    assert (nano.head_dim, nano.intermediate_size, nano.vocab_size) == (128, 12288, 151936)
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads) == (5120, 64, 64, 8)
    assert (big.head_dim, big.intermediate_size) == (128, 25600)
    for cfg in (nano, big):
        assert cfg.rope_axes_dim == (24, 20, 20) and cfg.rope_theta == 5e6 and cfg.patch_latent_dim == 192
