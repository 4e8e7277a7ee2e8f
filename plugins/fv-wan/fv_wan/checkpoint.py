"""Reading Wan transformer checkpoints on disk: their config in diffusers' terms, and their layout.

(Which card a checkpoint directory is -- a built-in one, or one derived from its configs -- is
``fv_wan.derive``.)

Two transformer layouts load: diffusers' (``WanTransformer3DModel`` names) and the original
Wan release's (``wan/modules/model.py`` names: ``dim``/``num_heads`` in ``config.json``,
``blocks.N.self_attn.q`` ... in the weights), renamed through the declared
``ORIGINAL_TO_DIFFUSERS_KEYMAP``. The layout is detected from the files themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from fv_kernel.api import InstanceOptions, ModelCard

from fv_wan.models.transformer import ORIGINAL_KEY_PREFIXES, WanTransformerConfig

__all__ = ["transformer_config_from_disk", "is_original_layout", "same_architecture", "seed_of"]

#: The original release's CLIP (open-clip ViT-H/14) width, which I2V's ``image_dim`` takes.
_ORIGINAL_I2V_IMAGE_DIM = 1280


def transformer_config_from_disk(config: Mapping[str, Any]) -> dict[str, Any]:
    """A transformer ``config.json`` in diffusers' field names; the original release's is translated.

    Original fields (``WanModel``): ``dim``, ``num_heads``, ``num_layers``, ``ffn_dim``, ``freq_dim``,
    ``in_dim``, ``out_dim``, ``eps``, ``text_dim``, ``patch_size``, ``cross_attn_norm``, ``model_type``
    (``i2v``/``flf2v`` add the CLIP image branch, diffusers' ``image_dim`` and ``added_kv_proj_dim``).
    """
    if "dim" not in config or "num_heads" not in config:
        return dict(config)
    dim, heads = int(config["dim"]), int(config["num_heads"])
    translated: dict[str, Any] = {
        "num_attention_heads": heads, "attention_head_dim": dim // heads, "num_layers": config["num_layers"],
        "ffn_dim": config["ffn_dim"], "freq_dim": config.get("freq_dim", 256), "in_channels": config["in_dim"],
        "out_channels": config["out_dim"], "eps": config.get("eps", 1e-6), "text_dim": config.get("text_dim", 4096),
        "patch_size": tuple(config.get("patch_size", (1, 2, 2))), "cross_attn_norm": config.get("cross_attn_norm", True),
    }  # fmt: skip
    if config.get("model_type") in ("i2v", "flf2v"):
        translated.update(image_dim=_ORIGINAL_I2V_IMAGE_DIM, added_kv_proj_dim=dim)
    if config.get("model_type") == "flf2v":
        translated["pos_embed_seq_len"] = 2 * 257  # first and last frame, 257 CLIP tokens each
    return translated


def same_architecture(found: WanTransformerConfig, expected: WanTransformerConfig) -> bool:
    """Equal configs, up to ``rope_max_seq_len``: it bounds the RoPE table (positions are computed,
    not learned, and equal below the bound), and original-layout configs do not record it; and up to
    ``has_gate_compress``: the card says whether the weights carry VSA gates (their config.json need
    not), and the strict key check then requires them."""
    return found.model_copy(
        update={"rope_max_seq_len": expected.rope_max_seq_len, "has_gate_compress": expected.has_gate_compress}
    ) == expected


def is_original_layout(keys: Any) -> bool:
    """True for transformer weights named as the original Wan release names them."""
    for key in keys:
        stripped = next((key[len(p) :] for p in ORIGINAL_KEY_PREFIXES if key.startswith(p)), key)
        if stripped == "head.head.weight":
            return True
    return False


def seed_of(card: ModelCard, component_id: str, options: InstanceOptions) -> int | None:
    """The seed a component's random weights are drawn with in this load, or None when it loads from files.

    No source at all: every component is seeded (``random_init_seed``, else 0). The card's own source
    (``checkpoint.source``, also when ``options.source`` names that same checkpoint, as ``fv generate
    --model FOLDER`` does): a component with a ``random_init_seed`` stays seeded beside the others'
    files (``fv quantize`` of wan-tiny writes its transformer and keeps its VAE and text encoder
    seeded). Another source named by the deployment (``options.source``) loads every component from
    that checkpoint. A component given a file of its own (``options.component_sources``) loads from it.
    """
    if component_id in options.component_sources:  # a file of its own (fv_kernel.api.component_source)
        return None
    seed = card.checkpoint.components[component_id].random_init_seed
    own, named = card.checkpoint.source, options.source
    if own is None and named is None:
        return seed or 0
    if named is None or (own is not None and _same_source(named, own)):
        return seed
    return None


def _same_source(a: str, b: str) -> bool:
    """Two checkpoint sources name one checkpoint: the same local folder, or the same hub id."""
    if a == b:
        return True
    left, right = Path(a).expanduser(), Path(b).expanduser()
    return left.exists() and right.exists() and left.resolve() == right.resolve()
