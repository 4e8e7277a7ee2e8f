"""The resident, loaded card: components, executable steps and bound loops.

A :class:`ModelInstance` holds weights and nothing per request. Loops describe steps
that name one of its :class:`StepOp` s; the runtime runs those ops, alone or
batched across requests.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
from torch import nn

from fv_kernel.cache.adapters import AdapterInfo, AdapterRegistry
from fv_kernel.cache.block_pool import BlockPool
from fv_kernel.compute.compile import TierSelection
from fv_kernel.compute.lora import AdapterError, MergedAdapters, RowAdapters, merge_adapters, select_row_kernel
from fv_kernel.card.refs import import_object
from fv_kernel.card.spec import FP8_LINEAR_PATHS, LoopSpec, ModelCard, StepCostSpec
from fv_kernel.errors import InvalidRequest, RecipeMismatch
from fv_kernel.loop.contract import Loop
from fv_kernel.loop.plan import StepOp, TensorDict
from fv_kernel.model.adapters import combined_stack
from fv_kernel.model.component_sources import check_component_sources
from fv_kernel.model.preflight import preflight
from fv_kernel.card.recipe import check_recipe_attention
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.precision import (
    FP8_ATTENTION_BACKEND, PrecisionPathSelection, select_precision_path, stores_fp8, uses_fp8_attention,
)
from fv_kernel.plugins.registry import DeployRegistry, kernel_registry
from fv_kernel.program.base import Program, program_for
from fv_kernel.request.request import Request
from fv_kernel.request.types import TaskType

__all__ = [
    "ModelInstance", "MergeGate", "loop_class_for", "build_instance", "ADAPTER_LOOP", "ADAPTER_LOAD_OP",
    "ADAPTER_LOAD_COST", "ADAPTER_MERGE_COST",
]

#: The kernel's own step that copies an adapter to the instance's device (a ``cache_io`` unit the
#: scheduler runs between other requests' steps), under this loop id.
ADAPTER_LOOP = "fv.adapters"
ADAPTER_LOAD_OP = "fv.adapter_load"
#: Declared price of an adapter load: per byte, at a conservative 8 GB/s host-to-device copy; the
#: profiler calibrates it from the loads it times.
ADAPTER_LOAD_COST = StepCostSpec(unit="bytes", fixed_seconds=1e-4, per_unit_seconds=1.0 / 8e9, precision_factor={},
                                 conservative_factor=1.5)
#: Declared price of merging (or unmerging) a stack: per parameter element rewritten; calibrated
#: from the transitions the instance times.
ADAPTER_MERGE_COST = StepCostSpec(unit="params", fixed_seconds=1e-4, per_unit_seconds=2e-9, precision_factor={},
                                  conservative_factor=1.0)

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
    #: Per task: its program's loops that override ``Loop.check_request`` (resolved once, on first use).
    _request_checkers: dict[TaskType, tuple[str, ...]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: The deployment's adapter registry (set by the engine); None: adapters are disabled.
    adapters: AdapterRegistry | None = None
    #: Per component, the stack merged into its weights now: ((version, scale), ...) and the restore.
    _merged: dict[str, tuple[tuple[tuple[str, float], ...], MergedAdapters]] = field(default_factory=dict)
    #: The executor's gate per device thread (``merge_gate``): two lanes may run batches at once.
    _gates: threading.local = field(default_factory=threading.local, repr=False)
    #: The per-row kernel every routed forward of this instance uses (``RowAdapters``' ``kernel``),
    #: one object per instance so a kernel's own caches (Triton's padded stacks) live as long as the instance.
    adapter_row_kernel: Any = field(default_factory=lambda: select_row_kernel("auto"))
    _profiles: dict[tuple[str, tuple[str, ...]], tuple[float, int]] = field(default_factory=dict)
    #: How ``build_instance`` resolved the deployment's ``precision_path`` (None: built otherwise;
    #: :attr:`precision_path` then resolves it from the options).
    precision_selection: PrecisionPathSelection | None = None
    #: How the family's factory resolved the compute tiers per component (``select_compute_tiers``;
    #: None: the factory does not select tiers).
    compute_selection: TierSelection | None = None

    @property
    def merge_gate(self) -> "MergeGate | None":
        """Set by the executor around each batch it runs (on the device thread): merge or per row.
        Per thread: a batch on another device lane has its own."""
        return getattr(self._gates, "gate", None)

    @merge_gate.setter
    def merge_gate(self, gate: "MergeGate | None") -> None:
        self._gates.gate = gate

    @property
    def model_id(self) -> str:
        return self.card.model_id

    @property
    def precision(self) -> str:
        return self.options.precision or self.card.precision.default

    @property
    def precision_path(self) -> str:
        """The precision path this instance runs (docs/precision.md), resolved at build: families read
        it when they load a component (``fv_kernel.model.precision.apply_precision_path``)."""
        if self.precision_selection is None:  # built without build_instance: resolve once
            self.precision_selection = select_precision_path(self.card, self.options)
        return self.precision_selection.path

    @property
    def fp8_linear_components(self) -> frozenset[str]:
        """The components whose fp8 targets run as ``Fp8Linear`` on this instance (its path quantizes
        linears, or its checkpoint stores them in fp8)."""
        targeted = {c for c, globs in self.card.precision.fp8_targets.items() if globs}
        if self.precision_path in FP8_LINEAR_PATHS:
            return frozenset(targeted)
        return frozenset(c for c in targeted if stores_fp8(self.card, c))

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
        if recipe.assumed_dtype is not None and self.precision != recipe.assumed_dtype:
            overrides.append("precision")
        if recipe.assumed_path is not None and self.precision_path != recipe.assumed_path:
            overrides.append("precision_path")
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
        # Checked under the lock: a load in flight on another thread holds it until its ops are built, so no
        # caller returns between its components appearing and the ops that run them.
        with self._lock:
            needed = [c for c in self.card.checkpoint.components_for(task) if c not in self.components]
            if not needed:
                return
            self._preflight(needed)
            with _COMPONENT_BUILDS:
                for component_id in needed:
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
        if name == ADAPTER_LOAD_OP and self.adapters is not None:
            return StepOp(ADAPTER_LOAD_OP, self._load_adapter, batch_invariant=True)
        try:
            return self._ops[name]
        except KeyError:
            raise KeyError(f"instance of {self.model_id!r} has no op {name!r} (loaded: {sorted(self._ops)})") from None

    def _load_adapter(self, inputs: TensorDict, params: Mapping[str, Any]) -> TensorDict:
        assert self.adapters is not None
        self.adapters.load(params["version"], self.device)
        return {}

    def step_cost(self, loop_id: str) -> StepCostSpec:
        """The declared price of a step of ``loop_id``: the card loop's, or the kernel's adapter loads'."""
        if loop_id == ADAPTER_LOOP:
            return ADAPTER_LOAD_COST
        return self.card.loops[loop_id].step_cost

    @property
    def ops(self) -> Mapping[str, StepOp]:
        return dict(self._ops)

    def block_pools(self) -> Mapping[str, BlockPool]:
        """The instance's block pools by name (e.g. ``{"text_kv": paged_pool, "chunk_kv": slab_pool}``); none by default.

        Any :class:`~fv_kernel.cache.block_pool.BlockPool` (a paged text-KV pool counts blocks, a
        slab chunk-KV pool slabs). The engine makes each one part of admission: a loop's estimate
        reserves blocks of it by name (``ResourceRequest.pool_blocks``) against its real capacity,
        so the loop's allocations cannot fail for lack of blocks.
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

    def request_checking_loops(self, task: TaskType) -> tuple[str, ...]:
        """The loops of ``task``'s program whose class overrides ``Loop.check_request``, in program order.

        Resolved once per instance and task (validation asks on every request). A loop whose class
        cannot be resolved is left out: its requests fail, typed, when the loop is built to run.
        """
        if task not in self._request_checkers:
            program = self.card.programs.get(task)
            checking = []
            for loop_id in program.loops if program is not None else ():
                try:
                    loop_class = self.loop_class(loop_id)
                except Exception:  # noqa: BLE001 - the engine logged it at load
                    continue
                if loop_class.check_request is not Loop.check_request:
                    checking.append(loop_id)
            self._request_checkers[task] = tuple(checking)
        return self._request_checkers[task]

    def program(self, task: TaskType) -> Program:
        return program_for(self.card, task)

    # ------------------------------------------------------------------ adapters (docs/adapters.md)

    @property
    def adapters_enabled(self) -> bool:
        return self.adapters is not None and self.adapters.settings.enabled

    def adapter_stack(self, request: Request, component: str | None = None) -> list[tuple[AdapterInfo, float]]:
        """The adapters ``request`` runs with (card defaults, then its own), at nonzero strength,
        those changing ``component`` only when one is given. Versions are the request's pinned ones."""
        if not self.adapters_enabled:
            return []
        assert self.adapters is not None
        stack = []
        for param, ref in combined_stack(self.card, request):
            if ref.scale == 0:
                continue
            info = self.adapters.get(ref.name, ref.version, param=param)
            if component is None or component in info.components:
                stack.append((info, ref.scale))
        return stack

    def adapter_inputs(self, request: Request, component: str, rows: int = 1) -> dict[str, torch.Tensor]:
        """``adapter_ids`` (int64 ``[rows, K]``, −1 pads) and ``adapter_scales`` (fp32 ``[rows, K]``)
        for ``component``'s forward: every row carries the request's stack. ``K`` is the
        deployment's ``adapters.max_stack`` for every request, so steps with different stacks
        (or none) have the same inputs and still batch. ``{}`` when adapters are disabled."""
        if not self.adapters_enabled:
            return {}
        assert self.adapters is not None
        k = self.adapters.settings.max_stack
        stack = self.adapter_stack(request, component)
        if len(stack) > k:
            raise InvalidRequest("adapters", f"{len(stack)} adapters change {component!r}", allowed=f"at most {k} (adapters.max_stack)")
        ids = torch.full((rows, k), -1, dtype=torch.int64)
        scales = torch.zeros((rows, k), dtype=torch.float32)
        for slot, (info, scale) in enumerate(stack):
            ids[:, slot] = self.adapters.id_of(info.version)
            scales[:, slot] = scale
        return {"adapter_ids": ids, "adapter_scales": scales}

    def adapter_versions(self, request: Request, component: str) -> tuple[tuple[str, str], ...]:
        """``CacheKey.adapter_versions`` for a value ``component`` computes: each adapter changing it,
        as ``(name, "<version>@<strength>")`` in stack order (a strength change is another key)."""
        return tuple((info.name, f"{info.version}@{scale!r}") for info, scale in self.adapter_stack(request, component))

    @staticmethod
    def _row_stacks(ids: torch.Tensor, scales: torch.Tensor) -> list[tuple[tuple[int, float], ...]]:
        return [
            tuple((int(i), float(s)) for i, s in zip(row_ids, row_scales) if int(i) >= 0)
            for row_ids, row_scales in zip(ids.tolist(), scales.tolist())
        ]

    def row_adapters(self, inputs: Mapping[str, torch.Tensor], component: str) -> RowAdapters | None:
        """The per-row routing of a (batched) forward of ``component`` from its step inputs, with
        the adapters' weights from the device tier; None when no row has an adapter, or when the
        one stack every row carries is merged into the weights.

        The merged-or-per-row choice is made here, where the component is known: a forward whose
        rows all carry one stack keeps (or, when the executor's :class:`MergeGate` says it pays,
        makes) that stack merged; any other forward first restores the base weights exactly.
        Without a gate (an op run outside the engine) nothing new is merged, and a component whose
        linears run in fp8 is never merged into.
        """
        ids = inputs.get("adapter_ids")
        if ids is None or self.adapters is None:
            return None
        scales = inputs["adapter_scales"]
        registry = self.adapters
        rows = self._row_stacks(ids, scales)
        uniform = rows[0] if rows and all(row == rows[0] for row in rows) else None
        stack = tuple((registry.version_of(i), s) for i, s in uniform) if uniform else ()
        gate = self.merge_gate
        allowed = gate is None or gate.allow_merge
        merged = self._merged.get(component)
        if merged is not None:
            if stack and stack == merged[0] and allowed:
                return None
            self._transition(component, (), gate)
        # An fp8 component's linears take their updates per row, always (merge_adapters refuses them).
        fp8 = component in self.fp8_linear_components
        if stack and gate is not None and gate.allow_merge and not fp8:
            if gate.should_merge(self, component, stack, *self._stack_profile(component, stack)):
                self._transition(component, stack, gate)
                return None
        elif gate is not None:
            gate.note_mixed(self, component)

        def lookup(adapter_id: int) -> Any:
            return registry.weights(registry.version_of(adapter_id), component, self.device)

        routing = RowAdapters.from_ids(ids, scales, lookup, kernel=self.adapter_row_kernel)
        if routing is not None and fp8:
            root = self.components[component]
            for segment in routing.segments:
                merge_only = segment.adapter.merge_only_params(root)
                if merge_only:
                    raise AdapterError(
                        f"adapter {segment.adapter.name!r} has full deltas on {', '.join(merge_only[:3])}, which apply "
                        f"merged only, and {component!r}'s linears run in fp8 on precision path "
                        f"{self.precision_path!r}, where nothing merges into it", param="adapters")
        return routing

    def _stack_profile(self, component: str, stack: tuple[tuple[str, float], ...]) -> tuple[float, int]:
        """What merging ``stack`` into ``component`` trades: the per-row updates' multiply-adds as a
        fraction of the component's linears' (a forward's extra cost unmerged), and the parameter
        elements a merge rewrites."""
        key = (component, tuple(v for v, _ in stack))
        cached = self._profiles.get(key)
        if cached is not None:
            return cached
        assert self.adapters is not None
        root = self.components[component]
        base = sum(m.in_features * m.out_features for m in root.modules() if isinstance(m, nn.Linear)) or 1
        params = dict(root.named_parameters())
        extra, touched = 0, set()
        for version, _ in stack:
            weights = self.adapters.weights(version, component, self.device)
            extra += sum(u.rank * (u.in_features + u.out_features) for u in weights.low_rank.values())
            extra += sum(int(t.numel()) for path, t in weights.deltas.items() if path.endswith(".weight"))
            touched |= {f"{p}.weight" for p in weights.low_rank} | {f"{p}.bias" for p, u in weights.low_rank.items() if u.bias is not None}
            touched |= set(weights.deltas)
        profile = (extra / base, sum(int(params[p].numel()) for p in touched if p in params))
        self._profiles[key] = profile
        return profile

    def _transition(self, component: str, stack: tuple[tuple[str, float], ...], gate: "MergeGate | None") -> None:
        """Merge ``stack`` (or, empty, only unmerge), timed and reported to ``gate`` (the cost model)."""
        started = time.perf_counter()
        elements = self.merge_stack(component, stack)
        if self.device.type == "cuda":
            # This thread's stream only: a device-wide wait would also wait for (and time) a batch on
            # the other device lane.
            torch.cuda.current_stream(self.device).synchronize()
        if gate is not None and elements:
            gate.note_transition(self, component, elements, time.perf_counter() - started)

    def merged_stack(self, component: str) -> tuple[tuple[str, float], ...] | None:
        """The stack (``(version, strength)`` pairs) merged into ``component`` now, if any."""
        merged = self._merged.get(component)
        return None if merged is None else merged[0]

    def merge_stack(self, component: str, stack: tuple[tuple[str, float], ...]) -> int:
        """Merge ``stack`` (``(version, strength)`` pairs) into ``component``'s weights, unmerging
        (an exact restore) whatever stack was merged before; an empty stack only unmerges. Returns
        the parameter elements rewritten (0 when nothing changed)."""
        # Strengths as a step's fp32 ``adapter_scales`` carry them, so a stack merged from Python
        # floats (0.8) is the one a forward's rows name (0.800000011920929).
        stack = tuple((version, float(torch.tensor(scale, dtype=torch.float32))) for version, scale in stack)
        if self.merged_stack(component) == stack:
            return 0
        elements = self.unmerge(component)
        if not stack:
            return elements
        assert self.adapters is not None
        root = self.components[component]
        if not isinstance(root, nn.Module):
            raise AdapterError(f"component {component!r} is not a torch module; adapters cannot merge into it")
        weights = [(self.adapters.weights(version, component, self.device), scale) for version, scale in stack]
        merged = merge_adapters(root, weights)
        self._merged[component] = (stack, merged)
        return elements + sum(int(t.numel()) for t in merged.originals.values())

    def unmerge(self, component: str) -> int:
        """Restore ``component``'s base weights bit-exactly, if a stack is merged into them; returns
        the parameter elements restored."""
        merged = self._merged.pop(component, None)
        if merged is None:
            return 0
        elements = sum(int(t.numel()) for t in merged[1].originals.values())
        merged[1].restore()
        return elements

    def unmerge_all(self) -> None:
        """Every component's base weights back (before a weight sync, or when adapters change)."""
        for component in list(self._merged):
            self.unmerge(component)


class MergeGate(Protocol):
    """The executor's say, for one batch, in whether a stack is merged (``fv_kernel.runtime.executor``)."""

    #: False for an exact batch or a deployment with ``adapters.merge: never``: nothing is merged.
    allow_merge: bool

    def should_merge(self, instance: ModelInstance, component: str, stack: tuple[tuple[str, float], ...],
                     flop_fraction: float, elements: int) -> bool: ...

    def note_mixed(self, instance: ModelInstance, component: str) -> None: ...

    def note_transition(self, instance: ModelInstance, component: str, elements: int, seconds: float) -> None: ...


def build_instance(card: ModelCard, options: InstanceOptions | None = None) -> ModelInstance:
    """Call the card's factory and preload the requested tasks."""
    options = options or InstanceOptions()
    if options.precision is not None and options.precision not in card.precision.supported:
        raise InvalidRequest(
            "precision", f"card {card.model_id!r} does not support {options.precision!r}",
            allowed=sorted(card.precision.supported),
        )
    precision = options.precision or card.precision.default
    assumed = card.recipe.assumed_dtype
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
    selection = select_precision_path(card, options)
    log.info("card %r runs precision path %r: %s", card.model_id, selection.path, selection.reason)
    options = options.model_copy(update={"precision_path": selection.path})
    if uses_fp8_attention(selection.path) and options.attention_backend != FP8_ATTENTION_BACKEND:
        if options.attention_backend != "sdpa":
            raise InvalidRequest(
                "precision_path", f"precision path {selection.path!r} runs attention through the "
                f"{FP8_ATTENTION_BACKEND!r} driver, but the deployment names attention_backend "
                f"{options.attention_backend!r}",
                allowed=f"attention_backend 'sdpa' (the default) or {FP8_ATTENTION_BACKEND!r} with this path, or a path "
                        f"without fp8 attention: {', '.join(p for p in card.precision.allowed_paths if not uses_fp8_attention(p))}",
            )
        options = options.model_copy(update={"attention_backend": FP8_ATTENTION_BACKEND})
    if check_recipe_attention(card, options.attention_backend, options.allow_recipe_mismatch):
        assert card.recipe.assumes_attention is not None
        log.warning(
            "card %r (recipe %r) assumes %s; deploying it with attention %r because the recipe was overridden",
            card.model_id, card.recipe.method, card.recipe.assumes_attention.describe(), options.attention_backend,
        )
    check_component_sources(card, options)
    factory = import_object(card.factory)
    instance = factory(card, options)
    if not isinstance(instance, ModelInstance):
        raise TypeError(f"{card.factory} returned {type(instance).__name__}, expected ModelInstance")
    instance.precision_selection = selection
    # Names a card gives (a registered loop, a sampler) resolve in this deployment now, not mid-request.
    for loop_id, spec in card.loops.items():
        if ":" not in spec.implementation:
            instance.loop_class(loop_id)
        if spec.sampler is not None:
            instance.registry.sampler(spec.sampler.name)
    for task in options.preload_tasks:
        instance.load_for_task(task)
    return instance
