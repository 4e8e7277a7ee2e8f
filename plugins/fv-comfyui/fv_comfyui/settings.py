"""fv-comfyui's deploy-config settings: ``plugins.settings.fv-comfyui`` (the kernel's per-plugin settings).

```yaml
plugins:
  settings:
    fv-comfyui:
      models: comfy-models.yaml   # the model mapping file (docs/comfyui.md)
      loras: ComfyUI/models/loras # the folder LoraLoader / LoraLoaderModelOnly's lora_name is read from
      diffusion_models: ComfyUI/models/diffusion_models  # UNETLoader's unet_name files (fv comfy run loads them)
      previews: true              # latent previews over /ws while a sampler runs (false: none)
```

The kernel checks only the plugin's name; the keys are checked here, strictly (an unknown key
is an error naming it). The ``FV_COMFY_MODELS`` environment variable, when set, overrides
``models``, as ``FV_PLUGINS`` overrides the config's plugin selection; ``FV_COMFY_LORAS``
overrides ``loras`` and ``FV_COMFY_DIFFUSION_MODELS`` overrides ``diffusion_models`` the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from pydantic import BaseModel, ConfigDict, ValidationError

from fv_kernel.api import DeployConfig

__all__ = ["DISTRIBUTION", "MODELS_ENV", "LORAS_ENV", "DIFFUSION_MODELS_ENV", "ComfySettings", "ComfySettingsError",
           "comfy_settings", "models_file", "loras_folder", "diffusion_models_folder"]

#: This plugin's distribution name: its key under ``plugins.settings``.
DISTRIBUTION = "fv-comfyui"
#: Overrides ``plugins.settings.fv-comfyui.models`` when set.
MODELS_ENV = "FV_COMFY_MODELS"
#: Overrides ``plugins.settings.fv-comfyui.loras`` when set.
LORAS_ENV = "FV_COMFY_LORAS"
#: Overrides ``plugins.settings.fv-comfyui.diffusion_models`` when set.
DIFFUSION_MODELS_ENV = "FV_COMFY_DIFFUSION_MODELS"


class ComfySettingsError(ValueError):
    """``plugins.settings.fv-comfyui`` is malformed; the message names the key."""


class ComfySettings(BaseModel):
    """The keys of ``plugins.settings.fv-comfyui``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: Path | None = None
    """The model mapping file; a relative path is read from the current directory, as the deploy
    config's other paths (``output_dir``) are."""

    loras: Path | None = None
    """ComfyUI's ``models/loras`` folder: the files ``lora_name`` offers (``.safetensors``, subfolders
    included); a relative path is read from the current directory."""

    diffusion_models: Path | None = None
    """ComfyUI's ``models/diffusion_models`` folder: ``fv comfy run`` loads a UNETLoader's ``unet_name`` file
    from it as the diffusion model its mapping names (an fp8_scaled file with its own scales); ``fv serve``
    serves the files its deploy config's ``cards[].component_sources`` name, and refuses a workflow naming
    another. Unset: a mapped name stands for the card's own weights."""

    previews: bool = True
    """Send ComfyUI's latent preview images over ``/ws`` at each sampler step (``fv serve``)."""


def comfy_settings(config: DeployConfig) -> ComfySettings:
    """This plugin's settings from ``config``, or :class:`ComfySettingsError` naming the bad key."""
    try:
        return ComfySettings.model_validate(config.plugins.settings_for(DISTRIBUTION))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ComfySettingsError(
            f"deploy config: plugins.settings.{DISTRIBUTION}.{where}: {first['msg']} "
            f"(allowed keys: {', '.join(ComfySettings.model_fields)})"
        ) from None


def _path_setting(config: DeployConfig, environ: Mapping[str, str] | None, variable: str, field: str) -> Path | None:
    """``variable`` from the environment when set (non-empty), else the deploy config's ``field``."""
    value = (os.environ if environ is None else environ).get(variable)
    if value:
        return Path(value)
    return getattr(comfy_settings(config), field)


def models_file(config: DeployConfig, environ: Mapping[str, str] | None = None) -> Path | None:
    """The mapping file to use: ``FV_COMFY_MODELS`` when set (non-empty), else the deploy config's ``models``."""
    return _path_setting(config, environ, MODELS_ENV, "models")


def loras_folder(config: DeployConfig, environ: Mapping[str, str] | None = None) -> Path | None:
    """The LoRA folder to use: ``FV_COMFY_LORAS`` when set (non-empty), else the deploy config's ``loras``."""
    return _path_setting(config, environ, LORAS_ENV, "loras")


def diffusion_models_folder(config: DeployConfig, environ: Mapping[str, str] | None = None) -> Path | None:
    """The diffusion_models folder to use: ``FV_COMFY_DIFFUSION_MODELS`` when set (non-empty), else the deploy
    config's ``diffusion_models``."""
    return _path_setting(config, environ, DIFFUSION_MODELS_ENV, "diffusion_models")
