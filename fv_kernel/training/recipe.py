"""A training recipe file: which method trains which card, with which options (``fv train --recipe``).

The kernel's part is the envelope (method, card, output card id, seed, device); the
method's own ``options`` parse through the method's ``options_schema``. A bad field is
one :class:`RecipeError` naming it (``options.dit.steps``), never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fv_kernel.errors import InvalidRequest

__all__ = ["TrainingRecipe", "RecipeError", "load_recipe", "parse_options"]


class RecipeError(InvalidRequest):
    """A recipe file that does not parse: the message names the file, the field and why."""

    error_type = "invalid_recipe"


class TrainingRecipe(BaseModel):
    """The envelope of a recipe file (YAML or JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: A registered ``rl_methods`` contribution: its short name or ``"<plugin>/<name>"``.
    method: str = Field(min_length=1)
    #: The card whose instance is trained: its architecture and starting weights. A card id, a card
    #: file, or the checkpoint folder an earlier ``fv train`` exported (training continues from it).
    card: str = Field(min_length=1)
    #: The id of the trained card the export writes (``fv-card.json`` beside the weights).
    output_model_id: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    #: One line for the trained card's ``summary``; default: the parent card's.
    summary: str | None = None
    seed: int = Field(default=0, ge=0)
    #: ``auto``: the first CUDA device when there is one, else the CPU.
    device: str = "auto"
    #: The method's options (its ``options_schema``).
    options: dict[str, Any] = Field(default_factory=dict)


def _field(err: Any, prefix: str = "") -> str:
    return prefix + (".".join(str(p) for p in err["loc"]) or "<recipe>")


def load_recipe(path: Path) -> TrainingRecipe:
    """Read and validate a recipe file; :class:`RecipeError` names the file and the first bad field."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError("recipe", f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise RecipeError("recipe", f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise RecipeError("recipe", f"{path} holds a {type(data).__name__}, not a mapping of recipe fields")
    try:
        return TrainingRecipe.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise RecipeError(_field(err), f"{err['msg']} (in {path})", allowed=_allowed(err, TrainingRecipe)) from None


def _allowed(err: Any, schema: type[BaseModel]) -> list[str] | None:
    if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
        return sorted(schema.model_fields)
    return None


def parse_options(recipe: TrainingRecipe, schema: type[BaseModel]) -> BaseModel:
    """``recipe.options`` through a method's schema; a bad one names ``options.<field>``."""
    try:
        return schema.model_validate(recipe.options)
    except ValidationError as exc:
        err = exc.errors()[0]
        allowed = sorted(schema.model_fields) if err["type"] == "extra_forbidden" and len(err["loc"]) == 1 else None
        raise RecipeError(_field(err, "options."), f"{err['msg']} (method {recipe.method!r})", allowed=allowed) from None
