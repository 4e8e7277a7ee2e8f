"""Reading an adapter (LoRA) file: its tensors and its safetensors metadata, with size and
format checks (docs/adapters.md). What the tensors mean is a card's converter's business
(``ModelCard.adapter_format``; the generic one is ``fv_kernel.model.adapters.convert_peft``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from fv_kernel.errors import AdapterFileError

__all__ = ["AdapterFile", "read_adapter_file", "read_adapter_bytes", "ADAPTER_SUFFIX", "ASSUMES_LOOP_KEY", "ASSUMES_STEPS_KEY"]

#: Adapter files are safetensors (pickled ``.pt``/``.ckpt`` files can run code when loaded).
ADAPTER_SUFFIX = ".safetensors"
#: Metadata keys by which a distilled adapter declares the loop (a card loop id) and the step
#: count it was distilled for (``RecipeMismatch`` otherwise, like a card's own recipe).
ASSUMES_LOOP_KEY = "fv.assumes_loop"
ASSUMES_STEPS_KEY = "fv.assumes_steps"
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class AdapterFile:
    """An adapter file's tensors (on the CPU), its ``__metadata__`` and the sha256 of its bytes."""

    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str]
    sha256: str
    size_bytes: int


def _metadata(data: bytes, where: str) -> dict[str, str]:
    if len(data) < 8:
        raise AdapterFileError(f"{where} is not a safetensors file: {len(data)} bytes")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(_MAX_HEADER, len(data) - 8):
        raise AdapterFileError(f"{where} is not a safetensors file: its header length {header_len} is past its end")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterFileError(f"{where} is not a safetensors file: its header is not JSON ({exc})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise AdapterFileError(f"{where}: __metadata__ must map strings to strings")
    return dict(meta)


def read_adapter_bytes(data: bytes, *, where: str = "adapter upload", max_bytes: int | None = None) -> AdapterFile:
    """Parse a safetensors adapter held in memory; :class:`AdapterFileError` names what is wrong."""
    if max_bytes is not None and len(data) > max_bytes:
        raise AdapterFileError(f"{where} is {len(data)} bytes, over the limit of {max_bytes} (adapters.max_file_bytes)")
    from safetensors import SafetensorError
    from safetensors.torch import load

    metadata = _metadata(data, where)
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterFileError(f"{where} is not a readable safetensors file: {exc}") from None
    if not tensors:
        raise AdapterFileError(f"{where} holds no tensors")
    return AdapterFile(tensors, metadata, hashlib.sha256(data).hexdigest(), len(data))


def read_adapter_file(path: str | Path, *, max_bytes: int | None = None) -> AdapterFile:
    """Read ``path`` (a ``.safetensors`` file): size checked before a byte is read."""
    path = Path(path)
    if path.suffix != ADAPTER_SUFFIX:
        raise AdapterFileError(f"adapter file {path} must be a {ADAPTER_SUFFIX} file")
    try:
        size = path.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise AdapterFileError(f"adapter file {path} is {size} bytes, over the limit of {max_bytes} (adapters.max_file_bytes)")
        data = path.read_bytes()
    except OSError as exc:
        raise AdapterFileError(f"cannot read adapter file {path}: {exc.strerror or exc}") from None
    return read_adapter_bytes(data, where=f"adapter file {path}", max_bytes=max_bytes)
