"""The card catalog: cards contributed by plugins, discovered through the plugin host.

Card ids are unique across plugins; two plugins contributing one id is an error
naming both (raised by the host's registration façade). A ``--model`` argument may
also be a card file (``.json`` / ``.yaml``, validated and build-checked before use), or
a local checkpoint directory or hub id: plugins map those to a card through the
``fv_resolve_model_source`` hook (an installed card's id, or a card they derive from the
checkpoint). Anything else is one typed error saying what is wrong with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from pydantic import ValidationError

from fv_kernel.model.buildcheck import BuildProblem, check_card_builds, problems_from_validation
from fv_kernel.card.spec import ModelCard
from fv_kernel.errors import CheckpointNotFound, FvError, InvalidRequest, UnknownModel

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.plugins.host import PluginHost
    from fv_kernel.plugins.registry import DeployRegistry

__all__ = ["CardEntry", "CardCatalog", "ResolvedModel", "CARD_FILE_SUFFIXES", "InvalidCardFile", "is_card_file", "read_card_file",
           "CARD_FILE", "read_card_file_beside"]

#: File suffixes ``--model`` reads as a card file.
CARD_FILE_SUFFIXES = (".json", ".yaml", ".yml")
#: The card an export (``fv train``, ``fv cards export``) writes beside the weights it exported.
CARD_FILE = "fv-card.json"


class InvalidCardFile(InvalidRequest):
    """A card file that does not validate or build; ``problems`` holds one line per bad field."""

    error_type = "invalid_card"

    def __init__(self, path: Path, problems: list[str]) -> None:
        super().__init__("model", f"card file {str(path)!r} is invalid: " + "; ".join(problems))
        self.path = path
        self.problems = problems


def is_card_file(model: str) -> bool:
    """Whether ``--model`` names a card file (by suffix; a directory never is one)."""
    path = Path(model).expanduser()
    return path.suffix.lower() in CARD_FILE_SUFFIXES and not path.is_dir()


def read_card_file(path: Path, *, registry: "DeployRegistry | None" = None) -> ModelCard:
    """A card from a ``.json`` / ``.yaml`` file: validated, then build-checked (no weights read),
    the names it gives resolving in ``registry`` (the deployment's; None: the kernel's built-ins).

    Raises :class:`CheckpointNotFound` when the file does not exist, :class:`InvalidRequest`
    when it cannot be read or parsed, and :class:`InvalidCardFile` naming every bad field.
    """
    import yaml

    if not path.is_file():
        raise CheckpointNotFound(f"model: no such card file: {str(path)!r}", param="model")
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise InvalidRequest("model", f"cannot read card file {str(path)!r}: {' '.join(str(exc).split())}") from None
    try:
        card = ModelCard.model_validate(data)
    except ValidationError as exc:
        raise InvalidCardFile(path, [str(p) for p in problems_from_validation(exc, "")]) from None
    problems = check_card_builds(card, registry=registry)
    if problems:
        raise InvalidCardFile(path, [str(p) for p in problems])
    return card


def read_card_file_beside(directory: Path, *, registry: "DeployRegistry | None" = None) -> ModelCard:
    """The card an export wrote beside its weights (``fv-card.json``), validated and build-checked,
    its checkpoint source pointed at ``directory`` wherever the folder now is."""
    card = read_card_file(directory / CARD_FILE, registry=registry)
    return card.model_copy(update={"checkpoint": card.checkpoint.model_copy(update={"source": str(directory)})})


def _looks_like_path(model: str) -> bool:
    # A hub id is "org/name": one slash, no leading '.', '/' or '~'.
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def _not_resolvable(model: str, entries: Mapping[str, Any]) -> FvError:
    """What is wrong with a ``--model`` that is no card id, card file or plugin-recognised source."""
    path = Path(model).expanduser()
    if path.is_dir():
        index = path / "model_index.json"
        if index.is_file():
            try:
                pipeline = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
            except (OSError, UnicodeDecodeError, ValueError, AttributeError):
                return InvalidRequest("model", f"{model!r} is not a checkpoint: its model_index.json is not valid JSON")
            return InvalidRequest(
                "model", f"{model!r} is a diffusers-layout checkpoint of pipeline {pipeline!r}, which no installed plugin serves"
            )
        return InvalidRequest(
            "model", f"{model!r} is a directory but not a checkpoint: it has no model_index.json "
            "(a diffusers-layout checkpoint's root file) and no installed plugin recognises it",
        )
    if path.exists():
        return InvalidRequest(
            "model", f"{model!r} is a file but not a card file",
            allowed=f"a card id, a card file ({', '.join(CARD_FILE_SUFFIXES)}), a checkpoint directory or a hub id",
        )
    if _looks_like_path(model):
        return CheckpointNotFound(f"model: no such file or directory: {model!r}", param="model")
    return UnknownModel(model, entries)


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

    @property
    def host(self) -> "PluginHost":
        """The plugin host whose enabled plugins contribute the cards (and whose registry they resolve in)."""
        return self._host

    def entries(self) -> dict[str, CardEntry]:
        self._host.start()
        entries: dict[str, CardEntry] = {}
        for contribution in self._host.hooks.model_cards().values():
            card = contribution.obj
            # The host checked it when the plugin registered: a ModelCard, registered under its model_id.
            assert isinstance(card, ModelCard) and contribution.name == card.model_id
            entries[card.model_id] = CardEntry(card=card, plugin=contribution.plugin)
        return dict(sorted(entries.items()))

    def get(self, model_id: str) -> ModelCard:
        entries = self.entries()
        if model_id not in entries:
            raise UnknownModel(model_id, entries)
        return entries[model_id].card

    def resolve(self, model: str) -> ResolvedModel:
        """The card ``model`` names, and where its weights load from.

        In order: an installed card id; a card file (validated and build-checked); a folder an
        export wrote (its ``fv-card.json``, build-checked, weights from the folder); a source a
        plugin recognises (it answers with an installed card's id, or a card it derived from the
        checkpoint, which is build-checked too). Otherwise a typed error saying what is wrong:
        no such path, a directory that is not a checkpoint, or an unknown card id.
        """
        entries = self.entries()
        if model in entries:
            return ResolvedModel(entries[model].card, None)
        if is_card_file(model):
            return ResolvedModel(read_card_file(Path(model).expanduser(), registry=self._host.registry()), None)
        exported = Path(model).expanduser()
        if (exported / CARD_FILE).is_file():  # an export's folder: its own card, not one derived from the weights
            card = read_card_file_beside(exported, registry=self._host.registry())
            return ResolvedModel(card, str(exported))
        answer = self._host.hooks.resolve_model_source(model)
        if isinstance(answer, ModelCard):
            if answer.model_id in entries:
                raise InvalidRequest(
                    "model", f"the card derived from {model!r} is named {answer.model_id!r}, which an installed card already is"
                )
            problems: list[BuildProblem] = check_card_builds(answer, registry=self._host.registry())
            if problems:
                raise InvalidRequest("model", f"the card derived from {model!r} does not build: " + "; ".join(map(str, problems)))
            return ResolvedModel(answer, model)
        card_id = answer
        if card_id is not None and "/" in card_id:  # a namespaced id, "<plugin>/<card>"
            card_id = card_id.rsplit("/", 1)[1]
        if card_id is not None and card_id in entries:
            return ResolvedModel(entries[card_id].card, model)
        raise _not_resolvable(model, entries)
