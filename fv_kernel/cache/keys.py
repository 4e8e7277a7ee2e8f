"""Cache keys that are correct by construction (design §7.1).

If a field can change the cached value, it is in the key: the model, component,
weights version, adapter versions, precision, parallel plan, shapes and input
hashes. Incorrect reuse is worse than no reuse.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CacheKey", "content_hash"]


def content_hash(value: Any) -> str:
    """A stable SHA-256 of strings, bytes, numbers, tensors (dtype, shape and bytes) and nested lists/dicts."""
    digest = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            t = item.detach().cpu().contiguous()
            digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(item, (bytes, bytearray)):
            digest.update(b"B" + bytes(item))
        elif isinstance(item, str):
            digest.update(b"S" + item.encode("utf-8") + b"\0")
        elif isinstance(item, (int, float, bool)) or item is None:
            digest.update(f"N{item!r}".encode())
        elif isinstance(item, (list, tuple)):
            digest.update(f"L{len(item)}".encode())
            for sub in item:
                feed(sub)
        elif isinstance(item, dict):
            digest.update(f"D{len(item)}".encode())
            for key in sorted(item):
                feed(str(key))
                feed(item[key])
        else:
            raise TypeError(f"content_hash cannot hash {type(item).__name__}")

    feed(value)
    return digest.hexdigest()


class CacheKey(BaseModel):
    """Everything that can change a cached value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str
    component_id: str
    weights_version: str
    adapter_versions: tuple[tuple[str, str], ...] = ()
    precision: str
    parallel_plan: str = "single"
    loop_id: str | None = None
    shape_sig: str = ""
    input_hash: str
    contract_version: str = "1"
    extra: tuple[tuple[str, str], ...] = Field(default=())

    def digest(self) -> str:
        return content_hash(self.model_dump(mode="json"))
