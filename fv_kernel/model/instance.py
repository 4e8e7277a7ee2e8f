"""The resident, loaded card: components, executable steps and bound loops.

A :class:`ModelInstance` holds weights and nothing per request. Loops describe steps
that name one of its :class:`StepOp` s; the runtime runs those ops, alone or
batched across requests.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from fv_kernel.cache.paged_kv import PagedKVPool
from fv_kernel.card.refs import import_object
from fv_kernel.card.spec import LoopSpec, ModelCard
from fv_kernel.errors import InvalidRequest, RecipeMismatch
from fv_kernel.loop.contract import Loop
from fv_kernel.loop.plan import StepOp
from fv_kernel.model.preflight import preflight
from fv_kernel.card.recipe import check_recipe_attention
from fv_kernel.model.options import InstanceOptions
from fv_kernel.plugins.registry import DeployRegistry, kernel_registry
from fv_kernel.program.base import Program, program_for
from fv_kernel.request.types import TaskType

__all__ = ["ModelInstance", "loop_class_for", "build_instance"]

log = logging.getLogger("fv.card")


def loop_class_for(spec: LoopSpec, registry: DeployRegistry) -> type[Loop]:
    """The class of a loop spec: ``implementation`` is a ``"module:Class"`` import string, or the
    name of a loop an enabled plugin registered (``"<plugin>/<name>"`` or a unique short name),
    resolved through ``registry``."""
    if ":" in spec.implementation:
        return import_object(spec.implementation)  # type: ignore[no-any-return]
    return registry.loop(spec.implementation)


#: One component build at a time in the process. The engine loads on worker threads, and loaders
#: touch process-wide state: a seeded random init re-seeds torch's global RNG (two concurrent ones
#: would draw from each other's seed), and lazily imported libraries (transformers) are not safe to
#: import from two threads at once.
_COMPONENT_BUILDS = threading.RLock()


@dataclass
class ModelInstance:
    """A card made resident. Shared by every request that runs on it; holds no per-request state."""

    card: ModelCard
    options: InstanceOptions
    #: Loads one component by id (lazily, on first use by a task that needs it).
    component_loader: Callable[[str], Any]
    #: Builds the instance's ops from its loaded components; re-run when components change.
    ops_builder: Callable[["ModelInstance"], dict[str, StepOp]]
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    weights_version: str = "unversioned"
    components: dict[str, Any] = field(default_factory=dict)
    _ops: dict[str, StepOp] = field(default_factory=dict)
    _loops: dict[str, Loop] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def model_id(self) -> str:
        return self.card.model_id

    @property
    def precision(self) -> str:
        return self.options.precision or self.card.precision.default

    @property
    def device(self) -> torch.device:
        return torch.device(self.options.device)

    @property
    def registry(self) -> DeployRegistry:
        """The deploy-scope registry this instance was built with (the kernel's built-ins when none was given)."""
        return self.options.registry if self.options.registry is not None else kernel_registry()

    @property
    def recipe_overrides(self) -> tuple[str, ...]:
        """The recipe fields this instance departs from (only under ``allow_recipe_mismatch``);
        loops copy them into their artifacts' ``Provenance.recipe_overrides``."""
        recipe = self.card.recipe
        overrides: list[str] = []
        if recipe.assumes_precision is not None and self.precision != recipe.assumes_precision:
            overrides.append("precision")
        if recipe.assumes_attention is not None and self.options.attention_backend != recipe.assumes_attention.kind:
            overrides.append("attention_backend")
        return tuple(overrides)

    def loaded_for(self, task: TaskType) -> bool:
        """Whether every component ``task`` needs is already loaded (then ``load_for_task`` only validates)."""
        return all(c in self.components for c in self.card.checkpoint.components_for(task))

    def load_for_task(self, task: TaskType) -> None:
        """Load every component the task needs (and nothing it does not)."""
        if task not in self.card.capabilities.tasks:
            raise InvalidRequest(
                "task", f"card {self.model_id!r} cannot run {task.value!r}",
                allowed=sorted(t.value for t in self.card.capabilities.tasks),
            )
        needed = [c for c in self.card.checkpoint.components_for(task) if c not in self.components]
        if not needed:
            return
        self._preflight(needed)
        with self._lock, _COMPONENT_BUILDS:
            for component_id in needed:
                if component_id not in self.components:
                    self.components[component_id] = self.component_loader(component_id)
            self._ops = self.ops_builder(self)

    def _preflight(self, component_ids: Sequence[str]) -> None:
        """Before loading: the components' checkpoint source is there and their weights fit
        (``fv_kernel.model.preflight``); a one-line typed error otherwise, nothing allocated."""
        preflight(self.card, self.options, component_ids=component_ids)

    def component(self, component_id: str) -> Any:
        if component_id not in self.components:
            self._preflight([component_id])
            with self._lock, _COMPONENT_BUILDS:
                if component_id not in self.components:
                    self.components[component_id] = self.component_loader(component_id)
                self._ops = self.ops_builder(self)
        return self.components[component_id]

    def op(self, name: str) -> StepOp:
        try:
            return self._ops[name]
        except KeyError:
            raise KeyError(f"instance of {self.model_id!r} has no op {name!r} (loaded: {sorted(self._ops)})") from None

    @property
    def ops(self) -> Mapping[str, StepOp]:
        return dict(self._ops)

    def block_pools(self) -> Mapping[str, PagedKVPool]:
        """The instance's block pools by name (e.g. ``{"text_kv": pool}``); none by default.

        The engine makes each one part of admission: a loop's estimate reserves blocks of
        it by name (``ResourceRequest.pool_blocks``) against its real capacity, so the
        loop's allocations cannot fail for lack of blocks.
        """
        return {}

    def loop(self, loop_id: str) -> Loop:
        """The card's loop ``loop_id``, built and bound (``Loop.bind``) once per instance.

        Loops hold no per-request state; what they bind is this instance's.
        """
        if loop_id not in self._loops:
            loop = self.loop_class(loop_id)(self.card.loops[loop_id])  # loop_class refuses an unknown loop_id
            loop.bind(self)
            self._loops[loop_id] = loop
        return self._loops[loop_id]

    def loop_class(self, loop_id: str) -> type[Loop]:
        """The class of the card's loop ``loop_id`` (:func:`loop_class_for`, names resolved through :attr:`registry`)."""
        spec = self.card.loops.get(loop_id)
        if spec is None:
            raise InvalidRequest("loop", f"card {self.model_id!r} has no loop {loop_id!r}", allowed=sorted(self.card.loops))
        return loop_class_for(spec, self.registry)

    def program(self, task: TaskType) -> Program:
        return program_for(self.card, task)


def build_instance(card: ModelCard, options: InstanceOptions | None = None) -> ModelInstance:
    """Call the card's factory and preload the requested tasks."""
    options = options or InstanceOptions()
    if options.precision is not None and options.precision not in card.precision.supported:
        raise InvalidRequest(
            "precision", f"card {card.model_id!r} does not support {options.precision!r}",
            allowed=sorted(card.precision.supported),
        )
    precision = options.precision or card.precision.default
    assumed = card.recipe.assumes_precision
    if assumed is not None and precision != assumed:
        if not options.allow_recipe_mismatch:
            raise RecipeMismatch(
                "precision", model_id=card.model_id, method=card.recipe.method, assumes=f"precision {assumed!r}",
                asked=(
                    f"an instance in precision {precision!r} (an explicit override deploys it anyway: "
                    "deploy config 'override_recipe: true', fv generate --override-recipe)"
                ),
            )
        log.warning(
            "card %r (recipe %r) assumes precision %r; deploying it in %r because the recipe was overridden",
            card.model_id, card.recipe.method, assumed, precision,
        )
    if check_recipe_attention(card, options.attention_backend, options.allow_recipe_mismatch):
        assert card.recipe.assumes_attention is not None
        log.warning(
            "card %r (recipe %r) assumes %s; deploying it with attention %r because the recipe was overridden",
            card.model_id, card.recipe.method, card.recipe.assumes_attention.describe(), options.attention_backend,
        )
    factory = import_object(card.factory)
    instance = factory(card, options)
    if not isinstance(instance, ModelInstance):
        raise TypeError(f"{card.factory} returned {type(instance).__name__}, expected ModelInstance")
    # Names a card gives (a registered loop, a sampler) resolve in this deployment now, not mid-request.
    for loop_id, spec in card.loops.items():
        if ":" not in spec.implementation:
            instance.loop_class(loop_id)
        if spec.sampler is not None:
            instance.registry.sampler(spec.sampler.name)
    for task in options.preload_tasks:
        instance.load_for_task(task)
    return instance
