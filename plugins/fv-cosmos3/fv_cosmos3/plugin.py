"""fv plugin entry point: registers the Cosmos 3 cards and maps local checkpoint folders to them."""

from __future__ import annotations

import json
from pathlib import Path

from fv_kernel.api import hookimpl


@hookimpl
def fv_register_model_cards(register) -> None:  # type: ignore[no-untyped-def]
    from fv_cosmos3.cards import cosmos3_cards  # imported only when cards are first needed

    for card in cosmos3_cards():
        register(card.model_id, card)


@hookimpl
def fv_resolve_model_source(source: str) -> str | None:
    """A local diffusers-layout Cosmos 3 checkpoint -> ``cosmos3-nano`` or ``cosmos3-super`` by its hidden size."""
    config_path = Path(source).expanduser() / "transformer" / "config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    if config.get("_class_name") != "Cosmos3OmniTransformer":
        return None
    return {4096: "cosmos3-nano", 5120: "cosmos3-super"}.get(int(config.get("hidden_size", 0)))
