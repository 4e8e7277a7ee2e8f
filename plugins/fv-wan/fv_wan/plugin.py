"""fv-wan's plugin module: registered under the ``fv.plugins`` entry point.

Kept light: cards are built (and model code imported) only when the host asks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fv_kernel.api import hookimpl


@hookimpl
def fv_register_model_cards(register: Any) -> None:
    from fv_wan.cards import causal_wan_cards, wan_cards

    from fv_wan.toy_card import wan_toy_card, wan_toy_causal_card, wan_toy_init_card

    for card in (*wan_cards(), *causal_wan_cards()):
        register(card.model_id, card)
    register("wan-toy-init", wan_toy_init_card())
    toy = wan_toy_card()
    if toy is not None:  # the trained weights ship as package data (fv_wan/weights/wan-toy/)
        register(toy.model_id, toy)
    toy_causal = wan_toy_causal_card()
    if toy_causal is not None:
        register(toy_causal.model_id, toy_causal)


@hookimpl
def fv_register_loops(register: Any) -> None:
    from fv_wan.causal import CausalWanRolloutLoop
    from fv_wan.loops import WanDecodeLoop, WanDenoiseLoop, WanImageEncodeLoop, WanTextEncodeLoop

    register("text_encode", WanTextEncodeLoop)
    register("image_encode", WanImageEncodeLoop)
    register("denoise", WanDenoiseLoop)
    register("decode", WanDecodeLoop)
    register("causal_rollout", CausalWanRolloutLoop)


@hookimpl
def fv_resolve_model_source(source: str) -> Any:
    """A card's own Hugging Face repo id maps to that card; a local Wan checkpoint directory to a card.

    For a directory (``fv_wan.derive``): None unless it is a Wan checkpoint; the built-in card
    that runs exactly its computation; else a card derived from its configs. A Wan checkpoint
    fv-wan cannot serve raises a typed error naming the missing file or unsupported field.
    """
    root = Path(source).expanduser()
    if root.is_dir():
        from fv_wan.derive import resolve_checkpoint_dir

        return resolve_checkpoint_dir(root)
    from fv_wan.cards import causal_wan_cards, wan_cards

    return next((card.model_id for card in (*wan_cards(), *causal_wan_cards()) if card.checkpoint.source == source), None)


@hookimpl
def fv_default_model() -> str | None:
    """``wan-toy``: the trained toy-world card whose output a person can judge (``wan-tiny`` is the parity card)."""
    return "wan-toy"


@hookimpl
def fv_export_checkpoint(card: Any, modules: Any, directory: Any) -> Any:
    """Wan cards export as diffusers ``WanPipeline`` directories (``fv_wan.export``)."""
    if card.family != "wan":
        return None
    from fv_wan.export import export_checkpoint

    return export_checkpoint(card, modules, Path(directory))


@hookimpl
def fv_check_parity(card: Any, directory: Any) -> Any:
    """A Wan directory's fv output against ``diffusers.WanPipeline.from_pretrained`` of it."""
    if card.family != "wan":
        return None
    from fv_wan.export import check_parity

    return check_parity(card, Path(directory))
