"""The card: what a deployable model declares (design §4). Specs, the recipe's teeth, checkpoints.

The resident side of a card (instances, request validation, the catalog) is
:mod:`fv_kernel.model`.
"""

from fv_kernel.card.spec import (
    CacheContract,
    CapabilityMatrix,
    CheckpointManifest,
    ComponentCheckpoint,
    ComponentSpec,
    LoopSpec,
    ModelCard,
    ParitySpec,
    RecipeSpec,
)

__all__ = [
    "CacheContract", "CapabilityMatrix", "CheckpointManifest", "ComponentCheckpoint", "ComponentSpec", "LoopSpec",
    "ModelCard", "ParitySpec", "RecipeSpec",
]
