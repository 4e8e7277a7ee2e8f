"""fv-wan's plugin module: registered under the ``fv.plugins`` entry point.

Kept light: cards are built (and model code imported) only when the host asks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fv_kernel.api import hookimpl


@hookimpl
def fv_register_model_cards(register: Any) -> None:
    from fv_wan.cards import wan_cards

    for card in wan_cards():
        register(card.model_id, card)


@hookimpl
def fv_register_loops(register: Any) -> None:
    from fv_wan.loops import WanDecodeLoop, WanDenoiseLoop, WanImageEncodeLoop, WanTextEncodeLoop

    register("text_encode", WanTextEncodeLoop)
    register("image_encode", WanImageEncodeLoop)
    register("denoise", WanDenoiseLoop)
    register("decode", WanDecodeLoop)


@hookimpl
def fv_resolve_model_source(source: str) -> str | None:
    """A card's own Hugging Face repo id, or a local diffusers-layout Wan checkpoint, maps to its card.

    A local directory maps to the first card with the same transformer (and VAE)
    architecture; the checkpoint's weights then replace the card's default source.
    """
    root = Path(source).expanduser()
    config_file = root / "transformer" / "config.json"
    if not config_file.is_file():
        from fv_wan.cards import wan_cards

        return next((card.model_id for card in wan_cards() if card.checkpoint.source == source), None)
    from fv_wan.checkpoint import match_card

    return match_card(root, json.loads(config_file.read_text()))


@hookimpl
def fv_default_model() -> str | None:
    return "wan-tiny"
