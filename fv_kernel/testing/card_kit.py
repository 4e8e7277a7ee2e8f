"""Card and loop conformance, and the requests every kit sends: base classes a model plugin
subclasses (the interleave gate built on them is :mod:`fv_kernel.testing.interleave_kit`).

::

    from fv_kernel.testing import CardConformance, InterleaveConformance

    class TestMyCards(CardConformance):
        card_ids = ["my-tiny"]                 # run end to end on CPU
        validate_only_ids = ["my-14b"]         # real sizes: validated, never built

    class TestMyInterleave(InterleaveConformance):
        card_ids = ["my-tiny"]

Cards are looked up through the installed plugins (a fresh :class:`PluginHost`);
override :meth:`load_card` to supply them directly. ``requests_for`` is where a plugin
adds its own requests, and ``steps`` shortens them (``docs/conformance.md``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Sequence

import pytest
import torch

from fv_kernel.model.catalog import CardCatalog
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import ModelInstance, build_instance, loop_class_for
from fv_kernel.card.spec import LoopSpec, ModelCard
from fv_kernel.model.validate import resolve_request
from fv_kernel.card.recipe import select_denoise_loop
from fv_kernel.errors import RecipeMismatch
from fv_kernel.loop.contract import Loop, LoopState
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.request import ARParams, DiffusionParams, ImagePart, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.local import run_local

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.plugins.host import PluginHost
    from fv_kernel.plugins.registry import DeployRegistry

__all__ = [
    "CardConformance",
    "sample_requests",
    "alternative_size",
    "GATE_PROMPTS",
    "GATE_NEGATIVE_PROMPTS",
    "SIZE_SEED_OFFSET",
    "assert_artifacts_identical",
    "forbid_module_calls",
    "roundtrip_state",
]

_SUPPORTED_TASKS = (TaskType.TEXT_TO_VIDEO, TaskType.TEXT_TO_IMAGE, TaskType.IMAGE_TO_VIDEO, TaskType.TEXT_GENERATION)

#: The kit's prompts, one per request of a task. Equal length in bytes and free of punctuation
#: (a family may strip a trailing period), so byte-tokenized prompts of one shape stay batchable
#: (a family may put prompt lengths in its shape signature); distinct in their first 15 bytes
#: (the toy text encoder's window).
GATE_PROMPTS: tuple[str, ...] = (
    "a red fox runs through snow", "a grey owl glides over pine", "an old ship drifts in a fog",
    "two cats nap on a warm roof", "city lights shimmer in rain", "a child flies a kite at sea",
    "waves crash on black stones", "a horse gallops up the hill",
)
#: Negative prompts, one per request of a task (equal length, for the same reason).
GATE_NEGATIVE_PROMPTS: tuple[str, ...] = ("blurry", "grainy", "smeary", "washed", "dimmed", "warped", "jagged", "smudge")
#: Seeds of the requests at the alternative size are offset by this (so no two requests share a seed).
SIZE_SEED_OFFSET = 1000


def alternative_size(card: ModelCard) -> tuple[int, int] | None:
    """A valid (height, width) other than the card's default, or None when the card admits none.

    Tries, in order: the larger side one ``spatial_multiple`` smaller, the smaller side one step
    smaller, then one step larger on either side; keeps sides positive multiples of
    ``spatial_multiple`` and the area within ``max_pixels``. Smaller first keeps the gate cheap.
    """
    caps = card.capabilities
    if caps.defaults is None:
        return None
    m, h, w = caps.spatial_multiple, caps.defaults.height, caps.defaults.width
    shrink = [(h - m, w), (h, w - m)] if h >= w else [(h, w - m), (h - m, w)]
    grow = [(h + m, w), (h, w + m)] if h <= w else [(h, w + m), (h + m, w)]
    for height, width in (*shrink, *grow):
        if height < m or width < m or height % m or width % m:
            continue
        if caps.max_pixels is not None and height * width > caps.max_pixels:
            continue
        return height, width
    return None


def _fixed_steps(card: ModelCard, request: Request) -> int | None:
    """The step count the denoise loop ``request`` would run bakes in (few-step recipes), else None."""
    loop_id = select_denoise_loop(card, request)
    binding = card.loops[loop_id].sampler if loop_id is not None else None
    return binding.fixed_steps if binding is not None else None


def sample_requests(
    card: ModelCard,
    *,
    seeds: Sequence[int] = (0,),
    prefix: str = "",
    steps: int | None = None,
    vary_size: bool = False,
    sampler: str | None = None,
) -> list[Request]:
    """Small requests covering every task the card declares that the kit knows how to build
    (text-to-video, text-to-image, image-to-video, text generation).

    Every task gets one request per seed, in ``seeds`` order; request ``i`` of a task has its own
    prompt (:data:`GATE_PROMPTS` ``[i]``), negative prompt and seed, and, where the card lets them
    vary, odd ``i`` differ from even ``i`` in:

    - **steps**: ``steps + 1`` (``steps`` defaults to the card's default). Not set at all when the
      denoise loop the request runs has ``fixed_steps`` (a few-step recipe);
    - **guidance** (and ``guidance_2`` on two-expert cards): the card's default + 1. Only when the
      default is above 1, so both stay above 1 and run the same CFG branches (and so can batch);
      never on a card with ``capabilities.uses_guidance`` False;
    - **max_tokens** of text generation: 5 instead of 4.

    With ``vary_size`` every diffusion task gets ``len(seeds)`` more requests at
    :func:`alternative_size` (seeds offset by :data:`SIZE_SEED_OFFSET`, prompts continuing the
    list), so each shape holds ``len(seeds)`` requests that can batch. Image-to-video requests
    carry a random image of their own size. ``sampler`` selects a non-default denoise loop (by
    its sampler name) for every diffusion request; text generation is then left out.
    """
    requests: list[Request] = []
    caps = card.capabilities
    defaults = caps.defaults
    alternative = alternative_size(card) if vary_size else None
    sizes: list[tuple[int, int] | None] = [None, alternative] if alternative is not None else [None]
    for task in sorted(caps.tasks, key=lambda t: t.value):
        if task not in _SUPPORTED_TASKS or (sampler is not None and task is TaskType.TEXT_GENERATION):
            continue
        groups = [None] if task is TaskType.TEXT_GENERATION else sizes
        if len(groups) * len(seeds) > len(GATE_PROMPTS):
            raise ValueError(
                f"seeds: {len(seeds)} requests per shape x {len(groups)} shapes exceeds the kit's {len(GATE_PROMPTS)} "
                f"prompts per task; allowed: at most {len(GATE_PROMPTS) // len(groups)} seeds"
            )
        for group, size in enumerate(groups):
            for i, base_seed in enumerate(seeds):
                n = group * len(seeds) + i
                odd = i % 2
                seed = base_seed + group * SIZE_SEED_OFFSET
                inputs: list[Any] = [TextPart(text=GATE_PROMPTS[n]), TextPart(text=GATE_NEGATIVE_PROMPTS[n], role="negative_prompt")]
                if task is TaskType.TEXT_GENERATION:
                    ar = ARParams(max_tokens=4 + odd, temperature=0.8, top_k=20, seed=seed)
                    requests.append(Request(
                        request_id=f"{prefix}{card.model_id}-{task.value}-{n}", model=card.model_id, task=task,
                        inputs=(inputs[0],), ar=ar,
                    ))
                    continue
                height, width = size if size is not None else ((defaults.height, defaults.width) if defaults else (16, 16))
                if task is TaskType.IMAGE_TO_VIDEO:
                    inputs.append(ImagePart(image=torch.rand(3, height, width, generator=torch.Generator().manual_seed(seed))))
                diffusion: dict[str, Any] = {"seed": seed, "sampler": sampler}
                fixed = _fixed_steps(card, Request(model=card.model_id, task=task, inputs=tuple(inputs),
                                                   diffusion=DiffusionParams(sampler=sampler)))
                if size is not None:
                    diffusion.update(height=height, width=width)
                if defaults is not None and fixed is None:
                    diffusion["steps"] = (steps or defaults.steps) + odd
                if defaults is not None and caps.uses_guidance:
                    if defaults.guidance > 1.0:
                        diffusion["guidance"] = defaults.guidance + odd
                    if defaults.guidance_2 is not None and defaults.guidance_2 > 1.0:
                        diffusion["guidance_2"] = defaults.guidance_2 + odd
                requests.append(Request(
                    request_id=f"{prefix}{card.model_id}-{task.value}-{height}x{width}-{n}", model=card.model_id,
                    task=task, inputs=tuple(inputs), diffusion=DiffusionParams(**diffusion),
                ))
    return requests


def _artifact_tensors(artifact: Artifact) -> dict[str, Any]:
    return {k: v for k, v in artifact.to_dict().items() if k != "provenance"}


def assert_artifacts_identical(left: Sequence[Artifact], right: Sequence[Artifact], *, what: str = "") -> None:
    """Bit-identical artifacts, with a readable message naming the first difference."""
    assert len(left) == len(right), f"{what}: {len(left)} artifacts vs {len(right)}"
    for index, (a, b) in enumerate(zip(left, right)):
        da, db = _artifact_tensors(a), _artifact_tensors(b)
        assert da.keys() == db.keys(), f"{what}: artifact {index} fields differ"
        for key in da:
            x, y = da[key], db[key]
            if isinstance(x, torch.Tensor):
                if x.shape != y.shape or not torch.equal(x, y):
                    diff = (x.float() - y.float()).abs().max().item() if x.shape == y.shape else "shape"
                    raise AssertionError(f"{what}: artifact {index} ({a.kind}) field {key!r} differs (max abs diff {diff})")
            else:
                assert x == y, f"{what}: artifact {index} ({a.kind}) field {key!r}: {x!r} != {y!r}"


@contextlib.contextmanager
def forbid_module_calls(active: list[bool]) -> Iterator[None]:
    """Fail if any ``nn.Module`` forward runs while ``active[0]`` is True."""

    def hook(module: torch.nn.Module, args: Any) -> None:
        if active[0]:
            raise AssertionError(f"Loop.next() ran a model kernel: {type(module).__name__}.forward was called")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def roundtrip_state(state: LoopState) -> LoopState:
    """Serialize a state to bytes and read it back (what a resume in another process sees)."""
    return type(state).from_bytes(state.to_bytes())


class _CardKitBase:
    card_ids: ClassVar[Sequence[str]] = ()
    #: Denoise steps of the kit's requests (None: each card's default). Set it to keep a suite fast;
    #: the interleave gate varies steps around it (``steps`` and ``steps + 1``).
    steps: ClassVar[int | None] = None

    def plugin_host(self) -> "PluginHost":
        """The host the kit finds cards and names through: the installed plugins, as ``fv`` sees them."""
        from fv_kernel.plugins.host import PluginHost

        host = self.__dict__.get("_fv_kit_host")
        if host is None:
            host = self.__dict__["_fv_kit_host"] = PluginHost()
        return host

    def registry(self) -> DeployRegistry:
        """The deploy-scope registry instances are built with, so a card may name its plugin's
        registered samplers and loops (override to check against another deployment)."""
        return self.plugin_host().registry()

    def load_card(self, model_id: str) -> ModelCard:
        return CardCatalog(self.plugin_host()).get(model_id)

    def build(self, card: ModelCard) -> ModelInstance:
        return build_instance(card, InstanceOptions(registry=self.registry()))

    def loop_class(self, spec: LoopSpec) -> type[Loop]:
        """A loop spec's class: its ``"module:Class"`` import string, or a loop registered by name."""
        return loop_class_for(spec, self.registry())

    def requests_for(
        self, card: ModelCard, *, seeds: Sequence[int] = (0,), prefix: str = "", vary_size: bool = False
    ) -> list[Request]:
        """The requests the kit runs on ``card``: the extension point for a plugin's own requests.

        The default is :func:`sample_requests` at :attr:`steps`. Override it to add requests
        (a non-default denoise loop: ``sample_requests(card, ..., sampler="euler")``; a task the
        kit cannot build), passing ``seeds``, ``prefix`` and ``vary_size`` on. Keep prefixing
        request ids with ``prefix``, build each shape at least ``len(seeds)`` times with
        different prompts and seeds (the interleave gate requires every request to batch with
        another), and shorten with :attr:`steps` rather than by overwriting ``diffusion.steps``
        (which would erase the step variation the gate checks for). See ``docs/conformance.md``.
        """
        return sample_requests(card, seeds=seeds, prefix=prefix, steps=self.steps, vary_size=vary_size)


class CardConformance(_CardKitBase):
    """Checks every card validates without weights, loops keep the contract, and state round-trips."""

    validate_only_ids: ClassVar[Sequence[str]] = ()

    def _all_ids(self) -> list[str]:
        return [*self.card_ids, *self.validate_only_ids]

    def test_card_validates_without_weights(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def no_weights(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("validating a card read weights")

        monkeypatch.setattr(torch, "load", no_weights)
        try:
            import safetensors.torch as st

            monkeypatch.setattr(st, "load_file", no_weights)
        except ImportError:  # pragma: no cover
            pass
        assert self._all_ids(), "set card_ids / validate_only_ids on the conformance class"
        for model_id in self._all_ids():
            card = self.load_card(model_id)
            again = ModelCard.model_validate(card.model_dump())
            assert again == card, f"{model_id}: card does not round-trip through model_dump/model_validate"

    def test_loops_implement_the_contract(self) -> None:
        for model_id in self._all_ids():
            card = self.load_card(model_id)
            for loop_id, spec in card.loops.items():
                cls = self.loop_class(spec)
                assert isinstance(cls, type) and issubclass(cls, Loop), f"{model_id}.{loop_id}: {spec.implementation} is not a Loop"
                assert cls.kind == spec.kind, f"{model_id}.{loop_id}: class kind {cls.kind!r} != spec kind {spec.kind!r}"
                assert issubclass(cls.state_type, LoopState), f"{model_id}.{loop_id}: state_type is not a LoopState"

    def test_next_runs_no_kernels(self) -> None:
        for model_id in self.card_ids:
            card = self.load_card(model_id)
            instance = self.build(card)
            active = [False]
            for loop_id in card.loops:
                loop = instance.loop(loop_id)
                original = loop.next

                def guarded(state: LoopState, _original: Any = original) -> Any:
                    active[0] = True
                    try:
                        return _original(state)
                    finally:
                        active[0] = False

                loop.next = guarded  # type: ignore[method-assign]
            try:
                with forbid_module_calls(active):
                    for request in self.requests_for(card):
                        run_local(request, instance)
            finally:
                for loop_id in card.loops:
                    instance.loop(loop_id).__dict__.pop("next", None)

    def test_loop_state_roundtrip_is_bit_identical(self) -> None:
        for model_id in self.card_ids:
            card = self.load_card(model_id)
            instance = self.build(card)
            for request in self.requests_for(card):
                plain = run_local(request, instance)
                resumed = run_local(request, instance, on_state=roundtrip_state)
                assert_artifacts_identical(plain, resumed, what=f"{model_id} {request.task.value} save/resume")

    def test_precision_paths_quantize_their_targets(self) -> None:
        """On each fp8 linear path a card lists, the family loads every ``fp8_targets`` linear as an
        ``Fp8Linear`` of the path's mode (``apply_precision_path``), and on ``native`` none."""
        from fv_kernel.compute.fp8 import Fp8Linear
        from fv_kernel.model.precision import fp8_target_paths

        for model_id in self.card_ids:
            card = self.load_card(model_id)
            components = [c for c, globs in card.precision.fp8_targets.items() if globs]
            paths = [p for p in ("fp8_weights", "fp8_dynamic") if p in card.precision.paths]
            if card.recipe.quantized_from is None and paths:
                paths.append("native")
            for path in paths:
                options = InstanceOptions(registry=self.registry(), precision_path=path, allow_recipe_mismatch=True)
                instance = build_instance(card, options)
                for component_id in components:
                    module = instance.component(component_id)
                    for name in fp8_target_paths(card, component_id, module):
                        layer = module.get_submodule(name)
                        if path == "native":
                            assert not isinstance(layer, Fp8Linear), f"{model_id} {component_id}.{name} is fp8 on native"
                        else:
                            assert isinstance(layer, Fp8Linear) and layer.mode == path, (
                                f"{model_id} on {path}: {component_id}.{name} is {layer!r}; the family's loader must call "
                                "apply_precision_path(card, component_id, module, instance.precision_path)")

    def test_recipe_mismatch_is_typed(self) -> None:
        for model_id in self._all_ids():
            card = self.load_card(model_id)
            assumed = card.recipe.assumes_loop
            if assumed is None or card.loops[assumed].sampler is None:
                continue
            binding = card.loops[assumed].sampler
            assert binding is not None
            other = "unipc" if binding.name != "unipc" else "euler"
            task = next(t for t in _SUPPORTED_TASKS if t in card.capabilities.tasks)
            bad = Request(model=card.model_id, task=task, inputs=(TextPart(text="x"),) + (
                (ImagePart(image=torch.rand(3, 16, 16)),) if task is TaskType.IMAGE_TO_VIDEO else ()),
                diffusion=DiffusionParams(sampler=other, steps=50))
            with pytest.raises(RecipeMismatch) as info:
                resolve_request(card, bad)
            assert card.recipe.method in str(info.value)


#: The step kinds that generate (denoise, token): each gate request must batch in them at least once.
