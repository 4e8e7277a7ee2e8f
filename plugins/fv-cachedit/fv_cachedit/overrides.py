"""Request schemas derived from deploy settings: each field optional, None keeps the deploy value."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, create_model

__all__ = ["overrides_model", "apply_overrides"]


def overrides_model(settings: type[BaseModel], name: str) -> type[BaseModel]:
    """A frozen (hashable) schema with every field of ``settings`` optional; unknown fields rejected.

    Constraints are checked on the merged result (:func:`apply_overrides`), so a bad value
    is reported under its own field name either way.
    """
    fields: dict[str, Any] = {key: (Optional[field.annotation], None) for key, field in settings.model_fields.items()}
    model = create_model(name, __config__=ConfigDict(extra="forbid", frozen=True), **fields)  # type: ignore[call-overload]
    model.__doc__ = f"Per-request overrides of :class:`{settings.__name__}` (None keeps the deploy value)."
    return model


def apply_overrides(config: BaseModel, params: BaseModel | None) -> Any:
    """``config`` with the request's non-None fields applied, validated by ``config``'s own model."""
    overrides = {} if params is None else params.model_dump(exclude_none=True)
    if not overrides:
        return config
    return type(config).model_validate({**config.model_dump(), **overrides})
