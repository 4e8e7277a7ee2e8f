"""What ``--model`` names, resolved once for every product that runs one card.

``fv generate`` and the Python façade (:func:`fv_kernel.load`) both take a card id, a card
file or a checkpoint directory (or nothing: the enabled plugins' default card), and a
deploy config whose ``cards`` entry for that model gives the instance options. This module
is the one place that turns those into a card, its weight source and its
:class:`~fv_kernel.model.instance.InstanceOptions`, so the two products cannot drift apart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from fv_kernel.model.catalog import CardCatalog
from fv_kernel.model.options import InstanceOptions
from fv_kernel.card.spec import PRECISION_PATHS, ModelCard
from fv_kernel.config import CardDeployment, DeployConfig
from fv_kernel.errors import InvalidRequest
from fv_kernel.plugins.host import PluginHost
from fv_kernel.request.types import PRECISIONS
from fv_kernel.deploy.options import deployment_options

__all__ = ["ModelChoice", "check_device", "default_model", "resolve_model"]


@dataclass(frozen=True)
class ModelChoice:
    """The card a ``--model`` names, where its weights load from, and how to build its instance."""

    card: ModelCard
    #: From the config's entry for the model (or the defaults), with the caller's overrides
    #: applied; ``options.source`` is the checkpoint when the model named a path or hub id.
    options: InstanceOptions


def default_model(host: PluginHost) -> str:
    """The card id the enabled plugins name as the default (``fv_default_model``), or a typed error."""
    chosen = host.hooks.default_model()
    if chosen is None:
        installed = sorted(CardCatalog(host).entries())
        raise InvalidRequest(
            "model", "no model given and no enabled plugin names a default card",
            allowed=installed or "none installed (install a plugin that contributes cards, e.g. from plugins/)",
        )
    return chosen


def check_device(device: str) -> None:
    """A typed error naming ``device`` for a string torch cannot parse or a device this machine lacks."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidRequest("device", f"{device!r} is not a torch device", allowed="cpu, cuda, cuda:N, mps") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("device", f"{device!r}: CUDA is not available on this machine", allowed="cpu")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidRequest("device", f"{device!r}: MPS is not available on this machine", allowed="cpu")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise InvalidRequest("device", f"{device!r} is not a device fv runs on", allowed="cpu, cuda, cuda:N, mps")


def resolve_model(
    model: str | None,
    config: DeployConfig,
    host: PluginHost,
    *,
    device: str | None = None,
    precision: str | None = None,
    override_recipe: bool = False,
    precision_path: str | None = None,
    component_sources: Mapping[str, str | os.PathLike[str]] | None = None,
) -> ModelChoice:
    """Resolve ``model`` (a card id, a card file, a checkpoint directory or hub id; None: the default card).

    The config's ``cards`` entry for the model (matched by what was given or by the card's
    id) gives the instance options; ``device``, ``precision``, ``precision_path`` and ``override_recipe`` win
    over it, and ``component_sources`` adds to (or replaces, per component) the entry's. Every error is
    typed and names its field; nothing is built or loaded here.
    """
    if precision is not None and precision not in PRECISIONS:
        raise InvalidRequest("precision", f"{precision!r} is not a precision", allowed=PRECISIONS)
    if precision_path is not None and precision_path not in (*PRECISION_PATHS, "auto"):
        raise InvalidRequest("precision_path", f"{precision_path!r} is not a precision path",
                             allowed=[*PRECISION_PATHS, "auto"])
    if device is not None:
        check_device(device)
    named = model if model is not None else default_model(host)
    resolved = CardCatalog(host).resolve(named)
    card = resolved.card
    deployment = next((c for c in config.cards if c.model in (named, card.model_id)), None) or CardDeployment(model=named)
    overrides: dict[str, Any] = {"device": device, "precision": precision, "precision_path": precision_path,
                 "override_recipe": True if override_recipe else None}
    if component_sources:
        overrides["component_sources"] = {**deployment.component_sources,
                                          **{str(k): Path(v) for k, v in component_sources.items()}}
    deployment = deployment.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    if device is None:
        check_device(deployment.device)  # the config entry's
    options = deployment_options(deployment, host.registry(), source=resolved.source)
    return ModelChoice(card=card, options=options)
