"""The model mapping file (``--comfy-models FILE``): ComfyUI model file names → fv cards.

```yaml
wan2.1_t2v_1.3B_fp16.safetensors: wan-tiny                   # a card
wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors: wan-tiny-a14b:transformer_2   # card:component
umt5_xxl_fp8_e4m3fn_scaled.safetensors: [wan-tiny, wan-tiny-i2v, wan-tiny-a14b]  # one file, several cards
```

Every name in the file is offered in each model loader's list (``unet_name``, ``clip_name``,
``vae_name``, ``ckpt_name``): a name with no mapping is ``value_not_in_list``, as an absent file
is in ComfyUI. LoRA files are not mapped: ``lora_name`` lists the LoRA folder's files
(:mod:`fv_comfyui.loras`). Which card a graph runs on is the compiler's to decide
(:mod:`fv_comfyui.compile`): the loaders of one graph must resolve to one card.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = ["ComfyModelsError", "ModelTarget", "ModelMap", "LOADER_FOLDERS"]

#: The folders ComfyUI's model loaders list; every mapped name is offered in each.
LOADER_FOLDERS = ("diffusion_models", "text_encoders", "vae", "clip_vision", "checkpoints")
_TARGET = re.compile(r"^(?P<card>[A-Za-z0-9][A-Za-z0-9._/-]*)(?::(?P<component>[A-Za-z_][A-Za-z0-9_]*))?$")


class ComfyModelsError(ValueError):
    """The mapping file is unreadable or malformed; the message names the file and the key."""


@dataclass(frozen=True)
class ModelTarget:
    """A card, and optionally one of its components (``wan-tiny-a14b:transformer_2``)."""

    card: str
    component: str | None = None

    @classmethod
    def parse(cls, text: Any, *, where: str) -> "ModelTarget":
        match = _TARGET.match(text) if isinstance(text, str) else None
        if match is None:
            raise ComfyModelsError(f"{where}: {text!r} is not a card id or 'card:component'")
        return cls(match["card"], match["component"])

    def __str__(self) -> str:
        return self.card if self.component is None else f"{self.card}:{self.component}"


@dataclass(frozen=True)
class ModelMap:
    """File name → the cards (and components) it stands for."""

    entries: Mapping[str, tuple[ModelTarget, ...]]

    @classmethod
    def from_data(cls, data: Any, *, source: str = "comfy models") -> "ModelMap":
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ComfyModelsError(f"{source}: expected a mapping of model file name -> card, got {type(data).__name__}")
        entries: dict[str, tuple[ModelTarget, ...]] = {}
        for name, value in data.items():
            where = f"{source}: {name!r}"
            if not isinstance(name, str) or not name:
                raise ComfyModelsError(f"{source}: key {name!r} must be a model file name")
            values = value if isinstance(value, list) else [value]
            if not values:
                raise ComfyModelsError(f"{where}: an empty list maps to no card")
            entries[name] = tuple(ModelTarget.parse(v, where=where) for v in values)
        return cls(entries)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ModelMap":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ComfyModelsError(f"comfy models file {str(path)!r}: cannot read it: {exc.strerror or exc}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ComfyModelsError(f"comfy models file {str(path)!r} is not valid YAML: {exc}") from None
        return cls.from_data(data, source=f"comfy models file {str(path)!r}")

    def folders(self) -> dict[str, list[str]]:
        names = sorted(self.entries)
        return {folder: names for folder in LOADER_FOLDERS}

    def targets(self, name: str) -> tuple[ModelTarget, ...]:
        return self.entries.get(name, ())

    def check_cards(self, known: set[str]) -> None:
        """Every card the file names is installed; else a typed error listing the installed ones."""
        for name, targets in self.entries.items():
            for target in targets:
                if target.card not in known:
                    raise ComfyModelsError(
                        f"comfy models: {name!r} maps to card {target.card!r}, which is not installed; "
                        f"installed: {', '.join(sorted(known))}"
                    )
