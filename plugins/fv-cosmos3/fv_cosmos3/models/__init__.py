"""Cosmos 3 model components: the two-tower MoT, its config, caches and key maps."""

from .config import Cosmos3Config
from .kv import TextKV
from .layers import AttentionFn, sdpa_attention
from .mot import Cosmos3MoT, GeneratorOutput
from .positions import generation_positions, media_grid_positions, text_positions
from .state_dict import (
    UnmappedKeysError,
    from_unified_state_dict,
    to_transformers_reasoner_state_dict,
)

__all__ = [
    "AttentionFn",
    "Cosmos3Config",
    "Cosmos3MoT",
    "GeneratorOutput",
    "TextKV",
    "UnmappedKeysError",
    "from_unified_state_dict",
    "generation_positions",
    "media_grid_positions",
    "sdpa_attention",
    "text_positions",
    "to_transformers_reasoner_state_dict",
]
