"""Declared key maps between checkpoint layouts.

* "unified" (this model == diffusers ``Cosmos3OmniTransformer``): flat keys,
  ``layers.N.self_attn.to_q`` etc. Loads with ``load_state_dict(strict=True)``.
* "transformers reasoner" (``Cosmos3OmniForConditionalGeneration``): the reasoner
  tower only, under ``model.language_model.`` with Qwen3-VL names (``q_proj``,
  ``q_norm``...) and a top-level ``lm_head``. Mirrors the ``cosmos3_omni`` renames in
  transformers' ``conversion_mapping.py``.

Every key must be either mapped or explicitly declared as dropped; anything else
raises ``UnmappedKeysError`` listing the offenders.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

TRANSFORMERS_TEXT_PREFIX = "model.language_model."

# Reasoner-tower attention renames, unified name -> transformers (Qwen3-VL) name.
_ATTN_RENAMES: tuple[tuple[str, str], ...] = (
    ("to_q", "q_proj"),
    ("to_k", "k_proj"),
    ("to_v", "v_proj"),
    ("to_out", "o_proj"),
    ("norm_q", "q_norm"),
    ("norm_k", "k_norm"),
)

# The unified (diffusers) key grammar, split by tower.
_REASONER_KEY = re.compile(
    r"^(embed_tokens\.weight|norm\.weight|lm_head\.weight"
    r"|layers\.\d+\.self_attn\.(to_q|to_k|to_v|to_out)\.(weight|bias)"
    r"|layers\.\d+\.self_attn\.(norm_q|norm_k)\.weight"
    r"|layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight"
    r"|layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight)$"
)
_GENERATOR_KEY = re.compile(
    r"^(norm_moe_gen\.weight"
    r"|layers\.\d+\.self_attn\.(add_q_proj|add_k_proj|add_v_proj|to_add_out)\.(weight|bias)"
    r"|layers\.\d+\.self_attn\.(norm_added_q|norm_added_k|k_norm_und_for_gen)\.weight"
    r"|layers\.\d+\.mlp_moe_gen\.(gate_proj|up_proj|down_proj)\.weight"
    r"|layers\.\d+\.(input_layernorm_moe_gen|post_attention_layernorm_moe_gen)\.weight"
    r"|(proj_in|proj_out)\.(weight|bias)"
    r"|time_embedder\.(linear_1|linear_2)\.(weight|bias)"
    r"|(audio_proj_in|audio_proj_out)\.(weight|bias)|audio_modality_embed"
    r"|(action_proj_in|action_proj_out)\.(fc|bias)\.weight|action_modality_embed)$"
)
# The reasoner's vision encoder (Qwen3-VL ViT): in unified checkpoints, flat; in
# transformers, under model.visual. This model carries no vision encoder.
_VISION_TOWER_KEY = re.compile(r"^(model\.visual\.|blocks\.|merger\.|patch_embed\.|pos_embed\.|deepstack_merger_list\.)")


class UnmappedKeysError(KeyError):
    """State-dict keys that no declared map covers."""

    def __init__(self, what: str, keys: list[str]) -> None:
        self.keys = sorted(keys)
        shown = ", ".join(self.keys[:20]) + (" ..." if len(self.keys) > 20 else "")
        super().__init__(f"{what}: {len(self.keys)} unmapped key(s): {shown}")


def is_reasoner_key(key: str) -> bool:
    return _REASONER_KEY.match(key) is not None


def is_generator_key(key: str) -> bool:
    return _GENERATOR_KEY.match(key) is not None


def _rename_attention(key: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for src, dst in pairs:
        marker = f".self_attn.{src}."
        if marker in key:
            return key.replace(marker, f".self_attn.{dst}.")
    return key


def to_transformers_reasoner_state_dict(
    state_dict: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Unified layout -> transformers ``Cosmos3OmniForConditionalGeneration`` text keys.

    Generator-tower keys are dropped (transformers drops them too). Only the Qwen3-VL
    reasoner (SwiGLU, text q/k-norm; Nano/Super) has a transformers counterpart here;
    an Edge (relu2) state dict raises.
    """
    out: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for key, tensor in state_dict.items():
        if is_generator_key(key):
            continue
        if not is_reasoner_key(key):
            unmapped.append(key)
            continue
        if key == "lm_head.weight":
            out[key] = tensor
        else:
            out[TRANSFORMERS_TEXT_PREFIX + _rename_attention(key, _ATTN_RENAMES)] = tensor
    if unmapped:
        raise UnmappedKeysError("to_transformers_reasoner_state_dict", unmapped)
    layers_with_up = {k.split(".")[1] for k in state_dict if re.match(r"^layers\.\d+\.mlp\.up_proj\.", k)}
    layers_with_gate = {k.split(".")[1] for k in state_dict if re.match(r"^layers\.\d+\.mlp\.gate_proj\.", k)}
    if layers_with_up - layers_with_gate:
        raise ValueError(
            "state dict has a gate-less (relu2, Cosmos 3 Edge) reasoner MLP; the transformers Qwen3-VL "
            "reasoner layout needs gate_proj (SwiGLU)"
        )
    return out


def from_unified_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    drop_vision_tower: bool = True,
) -> dict[str, torch.Tensor]:
    """Any supported checkpoint layout -> this model's (diffusers) layout.

    Accepts, per key:
    * the unified/diffusers names (kept);
    * flat reasoner keys with Qwen3-VL attention names (older unified checkpoints);
    * transformers reasoner keys (``model.language_model.*``, ``lm_head``);
    * vision-encoder keys, dropped when ``drop_vision_tower`` (this model has none).
    Raises ``UnmappedKeysError`` for anything else, and ``ValueError`` on a key that
    two layouts map to the same name.
    """
    inverse = tuple((dst, src) for src, dst in _ATTN_RENAMES)
    out: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for key, tensor in state_dict.items():
        if _VISION_TOWER_KEY.match(key):
            if drop_vision_tower:
                continue
            unmapped.append(key)
            continue
        name = key[len(TRANSFORMERS_TEXT_PREFIX) :] if key.startswith(TRANSFORMERS_TEXT_PREFIX) else key
        name = _rename_attention(name, inverse)
        if not (is_reasoner_key(name) or is_generator_key(name)):
            unmapped.append(key)
            continue
        if name in out:
            raise ValueError(f"from_unified_state_dict: two source keys map to {name!r} (mixed layouts?)")
        out[name] = tensor
    if unmapped:
        raise UnmappedKeysError("from_unified_state_dict", unmapped)
    return out
