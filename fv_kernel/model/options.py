"""How to build a resident instance of a card: the options a deployment gives ``build_instance``."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from fv_kernel.card.spec import PrecisionPathChoice
from fv_kernel.compute.compile import ComputeOptions
from fv_kernel.plugins.registry import DeployRegistry
from fv_kernel.request.types import Precision, TaskType

__all__ = ["InstanceOptions"]


class InstanceOptions(BaseModel):
    """How to build a resident instance of a card."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    device: str = "cpu"
    precision: Precision | None = None
    #: What runs in fp8 (docs/precision.md): a path the card lists in ``precision.paths``, ``native``,
    #: or ``auto`` (the fastest listed path whose recorded measurement passes its contract, else
    #: native). None: the card's own, the path its recipe assumes, else ``native``. The resolved
    #: path is ``ModelInstance.precision_path``.
    precision_path: PrecisionPathChoice | None = None
    #: Overrides the card's checkpoint source: a local directory or a hub repo id.
    source: str | None = None
    #: Component id -> one ``.safetensors`` file it loads from instead of the checkpoint, with the card's
    #: config (a component whose ``checkpoint.components`` entry is ``single_file``;
    #: :mod:`fv_kernel.model.component_sources`).
    component_sources: dict[str, Path] = Field(default_factory=dict)
    local_files_only: bool = False
    attention_backend: str = "sdpa"
    #: Fused kernels / compile / CUDA-graph tier of the denoiser (None: eager).
    compute: ComputeOptions | None = None
    #: Tasks whose components are loaded up front; others load on first use.
    preload_tasks: tuple[TaskType, ...] = ()
    #: The deploy-scope registry (samplers, loops, attention backends of the enabled plugins)
    #: names resolve through; None: the kernel's built-ins only. Set by the runtime from its
    #: plugin host (``host.registry()``); not configuration, so never serialised.
    registry: DeployRegistry | None = Field(default=None, exclude=True, repr=False)
    #: Deploy outside the card's recipe (a ``precision`` or ``precision_path`` its ``assumes_precision`` excludes, an
    #: ``attention_backend`` other than its ``assumes_attention``) instead of refusing with ``RecipeMismatch``. Logged, and kept on the instance
    #: (``ModelInstance.recipe_overrides``).
    allow_recipe_mismatch: bool = False
