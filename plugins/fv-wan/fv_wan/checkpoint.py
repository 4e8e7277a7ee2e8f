"""Recognising Wan checkpoints on disk: which card does a diffusers-layout directory hold?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from fv_wan.cards import wan_cards
from fv_wan.models.transformer import WanConfigError, WanTransformerConfig
from fv_wan.models.vae import WanVAEConfig

__all__ = ["match_card"]


def match_card(root: Path, transformer_config: Mapping[str, Any]) -> str | None:
    """The id of the card whose transformer and VAE configs equal the checkpoint's, or None.

    A real release matches its real card; a directory written by ``save_pretrained``
    from a tiny card's configs matches that tiny card. Among equal candidates, the
    one whose task set fits the checkpoint (an image encoder means image-to-video) wins.
    """
    try:
        found = WanTransformerConfig.from_diffusers_config(transformer_config)
    except WanConfigError:
        return None
    vae_file = root / "vae" / "config.json"
    vae = WanVAEConfig.from_diffusers_config(json.loads(vae_file.read_text())) if vae_file.is_file() else None
    has_expert_2 = (root / "transformer_2").is_dir()
    for card in wan_cards():
        if WanTransformerConfig.from_diffusers_config(card.components["transformer"].config) != found:
            continue
        if ("transformer_2" in card.components) != has_expert_2:
            continue
        if vae is not None and WanVAEConfig.from_diffusers_config(card.components["vae_decoder"].config) != vae:
            continue
        return card.model_id
    return None
