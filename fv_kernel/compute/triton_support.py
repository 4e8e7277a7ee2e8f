"""Whether Triton is there: the one question the compute modules ask before importing it (it is optional)."""

from __future__ import annotations

import importlib.util

__all__ = ["triton_available"]


def triton_available() -> bool:
    """Whether Triton can be imported (it is not a hard dependency of the kernel)."""
    return importlib.util.find_spec("triton") is not None
