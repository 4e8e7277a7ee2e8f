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
def fv_resolve_model_source(source: str) -> str | None:
    """A local diffusers-layout Wan checkpoint maps to the card with the same architecture."""
    root = Path(source).expanduser()
    config_file = root / "transformer" / "config.json"
    if not config_file.is_file():
        return None
    from fv_wan.checkpoint import match_card

    return match_card(root, json.loads(config_file.read_text()))


@hookimpl
def fv_default_model() -> str | None:
    return "wan-tiny"
