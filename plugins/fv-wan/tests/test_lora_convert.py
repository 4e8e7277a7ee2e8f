"""fv_wan.lora.convert_wan_lora: key mapping per format, expert targeting, and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fv_wan.lora import convert_wan_lora, target_component

from fv_kernel.api import AdapterError, AdapterKeyError


def _pair(rank: int = 2, out_features: int = 6, in_features: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(rank, in_features), torch.ones(out_features, rank)


@pytest.mark.parametrize(
    ("stem", "expected"),
    [
        ("diffusion_model.blocks.3.self_attn.o", "blocks.3.attn1.to_out.0"),
        ("diffusion_model.blocks.3.cross_attn.k_img", "blocks.3.attn2.add_k_proj"),
        ("diffusion_model.blocks.0.ffn.0", "blocks.0.ffn.net.0.proj"),
        ("model.diffusion_model.text_embedding.2", "condition_embedder.text_embedder.linear_2"),
        ("diffusion_model.img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
        ("lora_unet_blocks_12_cross_attn_v_img", "blocks.12.attn2.add_v_proj"),
        ("lora_unet_blocks_0_ffn_2", "blocks.0.ffn.net.2"),
        ("lora_unet_time_projection_1", "condition_embedder.time_proj"),
        ("lora_unet_time_embedding_0", "condition_embedder.time_embedder.linear_1"),
        ("lora_unet__blocks_1_self_attn_q", "blocks.1.attn1.to_q"),
        ("lora_unet_head_head", "proj_out"),
        ("transformer.blocks.0.attn1.to_q", "blocks.0.attn1.to_q"),
        ("base_model.model.blocks.0.attn2.to_k", "blocks.0.attn2.to_k"),
    ],
)
@pytest.mark.parametrize("suffixes", [("lora_down", "lora_up"), ("lora_A", "lora_B")])
def test_module_names_map_to_fv_names(stem: str, expected: str, suffixes: tuple[str, str]) -> None:
    down, up = _pair()
    state_dict = {f"{stem}.{suffixes[0]}.weight": down, f"{stem}.{suffixes[1]}.weight": up}
    adapter = convert_wan_lora(state_dict, name="x", metadata={})["transformer"]
    assert list(adapter.low_rank) == [expected]


def test_alpha_gives_alpha_over_rank_and_no_alpha_gives_one() -> None:
    down, up = _pair(rank=4)
    with_alpha = {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": down,
                  "diffusion_model.blocks.0.self_attn.q.lora_up.weight": up,
                  "diffusion_model.blocks.0.self_attn.q.alpha": torch.tensor(2.0)}  # fmt: skip
    assert convert_wan_lora(with_alpha, name="a", metadata={})["transformer"].low_rank["blocks.0.attn1.to_q"].scale == 0.5
    without = {k: v for k, v in with_alpha.items() if not k.endswith("alpha")}
    assert convert_wan_lora(without, name="a", metadata={})["transformer"].low_rank["blocks.0.attn1.to_q"].scale == 1.0


def test_peft_metadata_alpha_pattern_and_rslora() -> None:
    down, up = _pair(rank=4)
    state_dict = {
        "transformer.blocks.0.attn1.to_q.lora_A.weight": down, "transformer.blocks.0.attn1.to_q.lora_B.weight": up,
        "transformer.proj_out.lora_A.weight": down, "transformer.proj_out.lora_B.weight": up,
    }  # fmt: skip
    config = {"transformer.r": 4, "transformer.lora_alpha": 8, "transformer.alpha_pattern": {"proj_out": 2}}
    adapter = convert_wan_lora(state_dict, name="p", metadata={"lora_adapter_metadata": json.dumps(config)})["transformer"]
    assert adapter.low_rank["blocks.0.attn1.to_q"].scale == 2.0 and adapter.low_rank["proj_out"].scale == 0.5
    rs = {**config, "transformer.use_rslora": True}
    adapter = convert_wan_lora(state_dict, name="p", metadata={"lora_adapter_metadata": json.dumps(rs)})["transformer"]
    assert math.isclose(adapter.low_rank["blocks.0.attn1.to_q"].scale, 8 / math.sqrt(4))
    with pytest.raises(AdapterError, match="not JSON"):
        convert_wan_lora(state_dict, name="p", metadata={"lora_adapter_metadata": "{"})


def test_components_by_prefix_and_expert_targeting() -> None:
    down, up = _pair()
    te = {"text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": down,
          "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight": up}  # fmt: skip
    low = {"transformer_2.blocks.0.attn1.to_q.lora_A.weight": down, "transformer_2.blocks.0.attn1.to_q.lora_B.weight": up}
    original = {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": down,
                "diffusion_model.blocks.0.self_attn.q.lora_up.weight": up}  # fmt: skip
    both = convert_wan_lora({**te, **low}, name="both", metadata={})
    assert set(both) == {"text_encoder", "transformer_2"}
    # fv's text encoder holds the HF UMT5 model as .model
    assert list(both["text_encoder"].low_rank) == ["model.encoder.block.0.layer.0.SelfAttention.q"]
    assert set(convert_wan_lora(original, name="style", metadata={})) == {"transformer"}
    assert set(convert_wan_lora(original, name="style.transformer_2", metadata={})) == {"transformer_2"}
    assert set(convert_wan_lora(original, name="s", metadata={"fv_component": "transformer_2"})) == {"transformer_2"}
    assert target_component("lightx2v_high.transformer", {}) == "transformer"
    with pytest.raises(AdapterError, match="allowed: transformer, transformer_2"):
        convert_wan_lora(original, name="s", metadata={"fv_component": "transformer_3"})
    with pytest.raises(AdapterError, match="name says 'transformer_2'"):
        convert_wan_lora(original, name="s.transformer_2", metadata={"fv_component": "transformer"})


def test_a_key_that_maps_to_nothing_is_named() -> None:
    down, up = _pair()
    state_dict = {
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": down,
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": up,
        "diffusion_model.blocks.0.self_attn.qq.lora_down.weight": down,
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": down,
        "diffusion_model.blocks.0.self_attn.q.lora_mid.weight": down,
        "lora_unet_blocks_0_self_attn_q.hada_w1_a": down,  # LoHa
        "diffusion_model.blocks.0.self_attn.k.lokr_w1": down,  # LoKr
    }
    with pytest.raises(AdapterKeyError) as caught:
        convert_wan_lora(state_dict, name="odd", metadata={})
    assert caught.value.keys == sorted(k for k in state_dict if "self_attn.q.lora_" not in k or "mid" in k)
    assert "diffusion_model.blocks.0.self_attn.qq.lora_down.weight" in str(caught.value)
    assert caught.value.info()["type"] == "adapter_keys"


def test_dora_is_refused_not_dropped() -> None:
    down, up = _pair()
    state_dict = {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": down,
                  "diffusion_model.blocks.0.self_attn.q.lora_up.weight": up,
                  "diffusion_model.blocks.0.self_attn.q.dora_scale": torch.ones(1, 5)}  # fmt: skip
    with pytest.raises(AdapterError, match="DoRA.*dora_scale"):
        convert_wan_lora(state_dict, name="dora", metadata={})
    config = {"transformer.lora_alpha": 4, "transformer.use_dora": True}
    peft = {"transformer.blocks.0.attn1.to_q.lora_A.weight": down, "transformer.blocks.0.attn1.to_q.lora_B.weight": up}
    with pytest.raises(AdapterError, match="use_dora"):
        convert_wan_lora(peft, name="dora", metadata={"lora_adapter_metadata": json.dumps(config)})


@pytest.mark.parametrize(
    ("state_dict", "message"),
    [
        ({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(2, 5)}, "has a LoRA down but no up"),
        ({"diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(6, 2)}, "has a LoRA up but no down"),
        ({"diffusion_model.blocks.0.self_attn.q.alpha": torch.tensor(4.0)}, "alpha but no LoRA"),
        ({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(2, 5),
          "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(6, 2),
          "diffusion_model.blocks.0.self_attn.q.alpha": torch.ones(2)}, "must be a scalar"),
        ({"diffusion_model.blocks.0.self_attn.norm_q.diff": torch.zeros(5)}, "no updates"),
        ({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(2, 5),
          "diffusion_model.blocks.0.self_attn.q.lora_A.weight": torch.ones(2, 5),
          "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(6, 2)}, "two entries"),
        ({"lora_unet_blocks_0_ffn_0.lora_down.weight": torch.ones(2, 5, 1, 1),
          "lora_unet_blocks_0_ffn_0.lora_up.weight": torch.ones(6, 2, 1, 1)}, "must be 2-D"),
    ],
)  # fmt: skip
def test_malformed_files_get_a_clear_error(state_dict: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(AdapterError, match=message):
        convert_wan_lora(state_dict, name="bad", metadata={})


def test_norm_deltas_zero_dropped_nonzero_kept_and_modulation_is_a_parameter_delta() -> None:
    state_dict = {
        "diffusion_model.blocks.0.self_attn.norm_q.diff": torch.zeros(5),
        "diffusion_model.blocks.0.cross_attn.norm_k_img.diff": torch.ones(5),
        "diffusion_model.blocks.0.modulation.diff": torch.ones(1, 6, 5),
        "diffusion_model.blocks.0.modulation.diff_m": torch.ones(1, 6, 5),
        "diffusion_model.head.modulation.diff": torch.ones(1, 2, 5),
    }
    with pytest.raises(AdapterError, match="two entries"):
        convert_wan_lora(state_dict, name="m", metadata={})
    del state_dict["diffusion_model.blocks.0.modulation.diff_m"]
    adapter = convert_wan_lora(state_dict, name="m", metadata={})["transformer"]
    assert sorted(adapter.deltas) == ["blocks.0.attn2.norm_added_k.weight", "blocks.0.scale_shift_table", "scale_shift_table"]
