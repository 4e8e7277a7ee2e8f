"""One component's weights from a file of its own: a deployment's ``component_sources``.

ComfyUI keeps a diffusion model as one file (``models/diffusion_models/*_fp8_scaled.safetensors``),
apart from its text encoder and VAE; the original releases ship single files too. A deployment
names such a file per component (``InstanceOptions.component_sources``: component id -> path).
The component then loads from that file, with the card's own config, and every other component
from the card's checkpoint as before.

Only a component whose checkpoint entry says it can (``ComponentCheckpoint.single_file``) takes
one: its family's loader reads the file (:func:`component_source`). The checks here run before
anything loads (``build_instance``, the pre-flight), each a typed error naming the field. The
files enter the instance's ``weights_version`` (:func:`component_sources_version`), so caches
and captured graphs keyed by it never mix two files' weights.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from fv_kernel.card.spec import ModelCard
from fv_kernel.errors import CheckpointNotFound, InvalidRequest

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.model.options import InstanceOptions

__all__ = ["check_component_sources", "component_source", "component_sources_version", "SINGLE_FILE_SUFFIX"]

#: The one file format a component source may be.
SINGLE_FILE_SUFFIX = ".safetensors"


def _field(component_id: str) -> str:
    return f"component_sources.{component_id}"


def check_component_sources(card: ModelCard, options: "InstanceOptions") -> None:
    """Refuse a component source ``card`` cannot load: an unknown component, one whose checkpoint entry
    is not ``single_file``, or a path that is not an existing ``.safetensors`` file."""
    takes_file = [c for c, entry in card.checkpoint.components.items() if entry.single_file]
    for component_id, path in options.component_sources.items():
        if component_id not in card.checkpoint.components:
            raise InvalidRequest("component_sources", f"card {card.model_id!r} has no component {component_id!r}",
                                 allowed=takes_file or "none (no component of this card loads from a file of its own)")
        if not card.checkpoint.components[component_id].single_file:
            raise InvalidRequest(
                _field(component_id), f"card {card.model_id!r} loads {component_id!r} only from its checkpoint, not from "
                "a file of its own (checkpoint.components.*.single_file)",
                allowed=takes_file or "none (no component of this card loads from a file of its own)",
            )
        resolved = component_source(options, component_id)
        assert resolved is not None
        if resolved.suffix != SINGLE_FILE_SUFFIX:
            raise InvalidRequest(_field(component_id), f"{str(path)!r} is not a {SINGLE_FILE_SUFFIX} file",
                                 allowed=f"a path to one {SINGLE_FILE_SUFFIX} file")
        if not resolved.is_file():
            raise CheckpointNotFound(f"{_field(component_id)}: {str(path)!r} does not exist or is not a file",
                                     param=_field(component_id))


def component_source(options: "InstanceOptions", component_id: str) -> Path | None:
    """The file ``component_id`` loads from, or None (the card's checkpoint, or seeded weights)."""
    path = options.component_sources.get(component_id)
    return None if path is None else Path(os.path.expanduser(path))


def component_sources_version(options: "InstanceOptions") -> str:
    """A suffix for ``ModelInstance.weights_version`` naming each component file: its name and a digest of
    its path, size and modification time, so that another file (or this one rewritten) is another
    version. Empty without component sources."""
    parts = []
    for component_id in sorted(options.component_sources):
        path = component_source(options, component_id)
        assert path is not None
        stat = path.stat()
        digest = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        parts.append(f"+{component_id}={path.name}@{digest}")
    return "".join(parts)
