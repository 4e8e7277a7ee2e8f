"""File names from a request, resolved inside the folder they name a file of (never outside it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["inside"]


def inside(folder: Path, name: str) -> Path | None:
    """``folder / name`` resolved (``name`` may hold subfolders), or None when it leads outside ``folder``."""
    path = (folder / name).resolve()
    return path if folder.resolve() in path.parents else None
