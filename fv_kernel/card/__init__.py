"""The Model Plane: cards (specs), checkpoints, resident instances and request validation."""

from fv_kernel.card.instance import InstanceOptions, ModelInstance, StepOp, build_instance
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
from fv_kernel.card.validate import RequestLimits, resolve_request

__all__ = [
    "CacheContract", "CapabilityMatrix", "CheckpointManifest", "ComponentCheckpoint", "ComponentSpec", "InstanceOptions",
    "LoopSpec", "ModelCard", "ModelInstance", "ParitySpec", "RecipeSpec", "RequestLimits", "StepOp", "build_instance",
    "resolve_request",
]
