"""Checkpoint plumbing shared by every family: sources, safetensors shards, declared key maps.

Key maps are declared on the card (:class:`~fv_kernel.card.spec.KeyMapRule`), never
guessed. Loading checks keys strictly and reports missing and unexpected keys by
name; tensors are cast per key as they are assigned, so no second full-size copy of
the weights is materialised.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Mapping

import torch

from fv_kernel.card.spec import KeyMapRule
from fv_kernel.errors import CheckpointKeyError, CheckpointNotFound

__all__ = [
    "apply_key_map",
    "resolve_source",
    "read_safetensors",
    "load_into",
    "dtype_for_key",
]

_FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
_INDEX_NAMES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")


def apply_key_map(state_dict: Mapping[str, torch.Tensor], rules: Iterable[KeyMapRule]) -> dict[str, torch.Tensor]:
    """Rename keys with the declared rules, applied in order to every key."""
    compiled = [(re.compile(rule.pattern), rule.replacement) for rule in rules]
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        new_key = key
        for pattern, replacement in compiled:
            new_key = pattern.sub(replacement, new_key)
        if new_key in renamed:
            raise CheckpointKeyError("key_map", [], [f"{key} -> {new_key} (collides)"])
        renamed[new_key] = tensor
    return renamed


def resolve_source(source: str, *, subfolder: str = "", local_files_only: bool = False) -> Path:
    """A local directory for ``source``: a path as is, or a Hugging Face repo id downloaded/cached.

    Offline with nothing cached gives :class:`CheckpointNotFound` naming the source.
    """
    path = Path(os.path.expanduser(source))
    if path.exists():
        folder = path / subfolder if subfolder else path
        if not folder.is_dir():
            raise CheckpointNotFound(f"checkpoint {source!r} has no folder {subfolder!r}", param="model")
        return folder
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise CheckpointNotFound(
            f"checkpoint {source!r} is neither an existing directory nor a Hugging Face repo id ('org/name')",
            param="model",
        )
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - huggingface_hub is a plugin dependency
        raise CheckpointNotFound(f"loading {source!r} from the hub needs huggingface_hub: {exc}", param="model") from None
    offline = local_files_only or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    patterns = [f"{subfolder}/*"] if subfolder else None
    try:
        root = snapshot_download(source, allow_patterns=patterns, local_files_only=offline)
    except LocalEntryNotFoundError:
        raise CheckpointNotFound(
            f"{source!r} is not in the local Hugging Face cache and could not be downloaded "
            "(offline, HF_HUB_OFFLINE set, or the hub unreachable); download it first or pass a local directory",
            param="model",
        ) from None
    except Exception as exc:  # network errors, gated repos, typos
        raise CheckpointNotFound(f"could not fetch {source!r} from the Hugging Face hub: {exc}", param="model") from None
    return Path(root) / subfolder if subfolder else Path(root)


def read_safetensors(folder: Path, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a folder (a sharded index if present, else every ``*.safetensors`` file), or of
    one ``.safetensors`` file (a component source)."""
    from safetensors.torch import load_file

    if folder.is_file():
        return load_file(str(folder), device=device)

    for index_name in _INDEX_NAMES:
        index = folder / index_name
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                tensors.update(load_file(str(folder / shard), device=device))
            missing = sorted(set(weight_map) - set(tensors))
            if missing:
                raise CheckpointKeyError(folder.name, missing, [])
            return tensors
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFound(f"no .safetensors files in {folder}", param="model")
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file), device=device))
    return tensors


def dtype_for_key(key: str, dtype: torch.dtype, keep_fp32: Iterable[str]) -> torch.dtype:
    """fp32 for keys inside a kept-in-fp32 module (matched on dotted name parts), else ``dtype``."""
    parts = key.split(".")
    for name in keep_fp32:
        if name in parts:
            return torch.float32
    return dtype


def load_into(
    module: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    component: str,
    dtype: torch.dtype | None = None,
    keep_fp32: Iterable[str] = (),
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """Strictly load ``state_dict`` into ``module``, casting each tensor as it is assigned.

    Works on modules built on the ``meta`` device (``assign=True``), so the weights
    exist once, in their final dtype. fp8 tensors (an fp8 card's e4m3 weights) and their fp32
    ``weight_scale`` s keep their dtype: casting either would change the weights.
    """
    expected = set(module.state_dict().keys())
    given = set(state_dict.keys())
    missing = sorted(expected - given)
    unexpected = sorted(given - expected)
    if missing or unexpected:
        raise CheckpointKeyError(component, missing, unexpected)
    keep = tuple(keep_fp32)
    converted = {}
    for key, tensor in state_dict.items():
        stored_fp8 = tensor.dtype in _FP8_DTYPES or key.endswith("weight_scale")
        target = (dtype_for_key(key, dtype, keep) if dtype is not None and tensor.is_floating_point() and not stored_fp8
                  else tensor.dtype)
        converted[key] = tensor.to(device=device, dtype=target)
    module.load_state_dict(converted, strict=True, assign=True)
    return module
