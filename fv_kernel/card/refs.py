"""A card's ``"module:attr"`` references (its factory, loop and program implementations, its
parallelism implementation) resolved to objects."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_object"]


def import_object(reference: str) -> Any:
    """Resolve a ``"package.module:attr.sub"`` reference."""
    module_name, _, attr_path = reference.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj
