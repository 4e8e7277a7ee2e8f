"""ComfyUI's ``models/loras`` folder on fv: which files ``lora_name`` offers, what a file changes
on a card, and the engine adapters a compiled LoRA node runs as.

``lora_name`` is a path relative to the LoRA folder, ``/``-separated (``style/ink.safetensors``),
as ComfyUI lists it; never a path outside the folder. Only ``.safetensors`` files are offered:
fv does not unpickle ``.ckpt``/``.pt`` files. A file is converted by the card's own adapter
converter (``ModelCard.adapter_format``), so every LoRA format the card reads works here.

A LoRA node runs as one adapter of the request (:class:`LoraUse`): the file registered with the
engine under ``comfy.<lora_name without .safetensors, "/" as ".">``, with ``.transformer_2`` added
when the node is on a Wan 2.2 A14B card's low-noise chain (the name by which fv-wan's converter
puts a file's weights on the second expert), at the node's strength.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from fv_kernel.api import (
    AdapterError,
    AdapterFileError,
    AdapterRef,
    AdapterRegistry,
    AdapterWeights,
    ModelCard,
    ModelInstance,
    converter_for,
    read_adapter_file,
)

from fv_comfyui.paths import inside

__all__ = ["LORA_SUFFIX", "LoraFileError", "LoraUse", "LoraFolder", "LoraLibrary", "adapter_name", "adapter_refs",
           "adapter_registry"]

#: The only LoRA files offered (safetensors hold tensors, never code).
LORA_SUFFIX = ".safetensors"
#: The component a name suffix sends a file's diffusion-model weights to (fv-wan's converter).
SECOND_EXPERT = "transformer_2"
#: Converted files kept in memory between compiles (the newest ones): re-reading a 1 GB file
#: for every prompt would make ``POST /prompt`` slow.
_KEEP = 8
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class LoraFileError(ValueError):
    """A LoRA file is missing, unreadable, or maps to nothing of the card; the message says which."""


def adapter_registry(instance: ModelInstance) -> AdapterRegistry:
    """The adapter registry of a resident card (``ModelInstance.adapters``); :class:`LoraFileError`
    when the deployment has adapters disabled."""
    if not instance.adapters_enabled or instance.adapters is None:
        raise LoraFileError(f"card {instance.model_id!r} runs with adapters disabled (the deploy config's adapters: "
                            "section), so its LoRA nodes cannot run")
    return instance.adapters


@dataclass(frozen=True)
class LoraUse:
    """One LoRA node as one adapter of the request: a file, its registry name, what it changes, a strength."""

    node_id: str
    class_type: str
    lora_name: str
    path: Path
    #: The registry name (:func:`adapter_name`).
    adapter: str
    #: The card components the file's weights change (as converted under ``adapter``).
    components: tuple[str, ...]
    scale: float


def adapter_name(lora_name: str, expert: str | None) -> str:
    """The registry name of ``lora_name`` applied to ``expert`` (a Wan 2.2 second expert gets ``.transformer_2``)."""
    stem = lora_name[: -len(LORA_SUFFIX)] if lora_name.endswith(LORA_SUFFIX) else lora_name
    safe = _UNSAFE.sub("_", stem.replace("/", "."))
    if safe != stem.replace("/", "."):  # two odd names must not sanitise to one
        safe = f"{safe}.{hashlib.sha1(lora_name.encode()).hexdigest()[:6]}"
    suffix = f".{SECOND_EXPERT}" if expert == SECOND_EXPERT else ""
    return f"comfy.{safe[: 127 - len('comfy.') - len(suffix)]}{suffix}"


def adapter_refs(uses: Iterable[LoraUse]) -> tuple[AdapterRef, ...]:
    """The request's adapter stack, in node order; one file on one expert twice is one entry at the
    sum of the strengths (stacked patches of one file add up, in ComfyUI as in fv)."""
    scales: dict[str, float] = {}
    for use in uses:
        scales[use.adapter] = scales.get(use.adapter, 0.0) + use.scale
    return tuple(AdapterRef(name=name, scale=scale) for name, scale in scales.items() if scale != 0.0)


@dataclass(frozen=True)
class LoraFolder:
    """ComfyUI's ``models/loras`` folder: the names it offers and the file each name is."""

    root: Path

    def names(self) -> list[str]:
        """Every ``.safetensors`` file under the folder, as a ``/``-separated relative path, sorted."""
        if not self.root.is_dir():
            return []
        found = (p for p in self.root.rglob(f"*{LORA_SUFFIX}") if p.is_file())
        return sorted(p.relative_to(self.root).as_posix() for p in found)

    def path(self, name: str) -> Path | None:
        """The file ``name`` stands for, or None (absent, not ``.safetensors``, or outside the folder)."""
        if not name or not name.endswith(LORA_SUFFIX) or "\\" in name:
            return None
        path = inside(self.root, name)
        return path if path is not None and path.is_file() else None


class LoraLibrary:
    """A LoRA folder, and its files converted for cards (the newest few kept in memory)."""

    def __init__(self, folder: LoraFolder | None) -> None:
        self.folder = folder
        self._converted: OrderedDict[tuple[Any, ...], dict[str, AdapterWeights]] = OrderedDict()
        #: Per engine registry: adapter name -> the (size, mtime) of the file registered under it.
        self._registered: weakref.WeakKeyDictionary[AdapterRegistry, dict[str, tuple[int, int]]] = weakref.WeakKeyDictionary()

    def names(self) -> list[str]:
        return self.folder.names() if self.folder is not None else []

    def path(self, name: str) -> Path:
        """The file of ``name``; :class:`LoraFileError` when no folder is set or no such file is in it."""
        if self.folder is None:
            raise LoraFileError("no LoRA folder is set (ComfyUI's models/loras: --comfy-loras, FV_COMFY_LORAS or "
                                "plugins.settings.fv-comfyui.loras)")
        path = self.folder.path(name)
        if path is None:
            raise LoraFileError(f"{name!r} is not a {LORA_SUFFIX} file in the LoRA folder {str(self.folder.root)!r}")
        return path

    def components(self, card: ModelCard, path: Path, adapter: str) -> tuple[str, ...]:
        """The components of ``card`` that ``path``, converted as ``adapter``, changes; else :class:`LoraFileError`."""
        stat = path.stat()
        key = (card.model_id, card.adapter_format, str(path), stat.st_size, stat.st_mtime_ns, adapter)
        if key not in self._converted:
            try:
                file = read_adapter_file(path)
                converted = dict(converter_for(card)(dict(file.tensors), name=adapter, metadata=dict(file.metadata)))
            except (AdapterFileError, AdapterError) as exc:
                raise LoraFileError(" ".join(str(getattr(exc, "message", None) or exc).split())) from None
            if not converted:
                raise LoraFileError(f"no key of {path.name} maps to a module of card {card.model_id!r}")
            self._converted[key] = converted
            while len(self._converted) > _KEEP:
                self._converted.popitem(last=False)
        self._converted.move_to_end(key)
        return tuple(sorted(self._converted[key]))

    def register(self, registry: AdapterRegistry, uses: Iterable[LoraUse]) -> tuple[AdapterRef, ...]:
        """Register ``uses``' files with an engine's adapter registry (again only when a file changed
        since); the request's adapter stack."""
        uses = list(uses)
        stamps = self._registered.setdefault(registry, {})
        for use in uses:
            stat = use.path.stat()
            stamp = (stat.st_size, stat.st_mtime_ns)
            if stamps.get(use.adapter) != stamp or use.adapter not in registry.names():
                registry.add_file(use.path, name=use.adapter, source="file")
                stamps[use.adapter] = stamp
        return adapter_refs(uses)
