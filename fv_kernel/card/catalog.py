"""The card catalog: cards contributed by plugins, discovered through the plugin host.

Card ids are unique across plugins; two plugins contributing one id is an error
naming both (raised by the host's registration façade). A ``--model`` argument may
also be a local checkpoint directory or a hub id: plugins map those to a card
through the ``fv_resolve_model_source`` hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fv_kernel.card.spec import ModelCard
from fv_kernel.errors import UnknownModel

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.plugins.host import PluginHost

__all__ = ["CardEntry", "CardCatalog", "ResolvedModel"]


@dataclass(frozen=True)
class CardEntry:
    card: ModelCard
    plugin: str


@dataclass(frozen=True)
class ResolvedModel:
    """A card, plus the checkpoint source to load it from when ``--model`` named a path or hub id."""

    card: ModelCard
    source: str | None


class CardCatalog:
    """Every card the enabled plugins contribute, by ``model_id``."""

    def __init__(self, host: "PluginHost") -> None:
        self._host = host

    def entries(self) -> dict[str, CardEntry]:
        self._host.start()
        entries: dict[str, CardEntry] = {}
        for contribution in self._host.hooks.model_cards().values():
            card = contribution.obj
            assert isinstance(card, ModelCard)  # checked against the kind's base by the host
            if contribution.name != card.model_id:
                raise ValueError(
                    f"plugin {contribution.plugin!r} registered card {card.model_id!r} under the name {contribution.name!r}; "
                    "register cards under their model_id"
                )
            entries[card.model_id] = CardEntry(card=card, plugin=contribution.plugin)
        return dict(sorted(entries.items()))

    def get(self, model_id: str) -> ModelCard:
        entries = self.entries()
        if model_id not in entries:
            raise UnknownModel(model_id, entries)
        return entries[model_id].card

    def resolve(self, model: str) -> ResolvedModel:
        """A card id as is; otherwise ask plugins whether ``model`` is a checkpoint they can serve."""
        entries = self.entries()
        if model in entries:
            return ResolvedModel(entries[model].card, None)
        card_id = self._host.hooks.resolve_model_source(model)
        if card_id is not None and "/" in card_id:  # a namespaced id, "<plugin>/<card>"
            card_id = card_id.rsplit("/", 1)[1]
        if card_id is not None and card_id in entries:
            return ResolvedModel(entries[card_id].card, model)
        raise UnknownModel(model, entries)
