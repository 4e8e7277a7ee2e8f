"""How many weight elements each Cosmos 3 component holds, from its config alone.

The card declares these (``ComponentSpec.parameters``) so the kernel's pre-flight can refuse
a card whose weights do not fit before anything is built. Each count is the module built
on the ``meta`` device (no memory allocated) from the component's config: exact for the
code that loads it, parameters and buffers both.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import torch

from fv_kernel.api import ComponentSpec

__all__ = ["parameter_count"]


def _count(module: torch.nn.Module) -> int:
    return sum(t.numel() for t in module.parameters()) + sum(t.numel() for t in module.buffers())


@lru_cache(maxsize=32)
def _meta_count(component_id: str, config_json: str) -> int:
    from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT
    from fv_cosmos3.models.audio_vae import Cosmos3AudioDecoder, Cosmos3AudioDecoderConfig
    from fv_wan.models.vae import WanVAE, WanVAEConfig

    config: dict[str, Any] = json.loads(config_json)
    builders = {
        "transformer": lambda: Cosmos3MoT(Cosmos3Config(**config)),
        "vae": lambda: WanVAE(WanVAEConfig(**config)),
        "sound_decoder": lambda: Cosmos3AudioDecoder(Cosmos3AudioDecoderConfig(**config)),
    }
    if component_id not in builders:
        raise KeyError(f"Cosmos 3 has no weight-bearing component {component_id!r}; known: {sorted(builders)}")
    with torch.device("meta"):
        return _count(builders[component_id]())


def parameter_count(spec: ComponentSpec) -> int:
    """Weight elements of a Cosmos 3 component (0 for the tokenizer, which holds no tensors)."""
    if spec.kind == "tokenizer":
        return 0
    return _meta_count(spec.component_id, json.dumps(spec.config, sort_keys=True))
