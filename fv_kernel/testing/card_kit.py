"""Card, loop and interleave conformance: base classes a model plugin subclasses.

::

    from fv_kernel.testing import CardConformance, InterleaveConformance

    class TestMyCards(CardConformance):
        card_ids = ["my-tiny"]                 # run end to end on CPU
        validate_only_ids = ["my-14b"]         # real sizes: validated, never built

    class TestMyInterleave(InterleaveConformance):
        card_ids = ["my-tiny"]

Cards are looked up through the installed plugins (a fresh :class:`PluginHost`);
override :meth:`load_card` to supply them directly.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Iterator, Mapping, Sequence

import pytest
import torch

from fv_kernel.card.catalog import CardCatalog
from fv_kernel.card.instance import InstanceOptions, ModelInstance, build_instance, import_object
from fv_kernel.card.spec import ModelCard
from fv_kernel.errors import RecipeMismatch
from fv_kernel.loop.contract import Loop, LoopState
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.request import ARParams, DiffusionParams, ImagePart, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.engine import Engine, SchedulerConfig, run_concurrently, run_serially
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.runtime.local import run_local

__all__ = [
    "CardConformance",
    "InterleaveConformance",
    "CachedInterleaveConformance",
    "sample_requests",
    "assert_artifacts_identical",
    "forbid_module_calls",
    "roundtrip_state",
]

_SUPPORTED_TASKS = (TaskType.TEXT_TO_VIDEO, TaskType.TEXT_TO_IMAGE, TaskType.IMAGE_TO_VIDEO, TaskType.TEXT_GENERATION)


def sample_requests(card: ModelCard, *, seeds: Sequence[int] = (0,), prefix: str = "") -> list[Request]:
    """Small requests covering every task the card declares that the kit knows how to build."""
    requests = []
    defaults = card.capabilities.defaults
    for task in sorted(card.capabilities.tasks, key=lambda t: t.value):
        if task not in _SUPPORTED_TASKS:
            continue
        for seed in seeds:
            inputs: list[Any] = [TextPart(text="a red fox runs through snow"), TextPart(text="blurry", role="negative_prompt")]
            if task is TaskType.IMAGE_TO_VIDEO:
                h, w = (defaults.height, defaults.width) if defaults else (16, 16)
                image = torch.rand(3, h, w, generator=torch.Generator().manual_seed(seed))
                inputs.append(ImagePart(image=image))
            ar = ARParams(max_tokens=4, temperature=0.8, top_k=20, seed=seed) if task is TaskType.TEXT_GENERATION else None
            requests.append(
                Request(
                    request_id=f"{prefix}{card.model_id}-{task.value}-{seed}", model=card.model_id, task=task,
                    inputs=tuple(inputs), diffusion=DiffusionParams(seed=seed), ar=ar,
                )
            )
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

    def load_card(self, model_id: str) -> ModelCard:
        from fv_kernel.plugins.host import PluginHost

        return CardCatalog(PluginHost()).get(model_id)

    def build(self, card: ModelCard) -> ModelInstance:
        return build_instance(card, InstanceOptions())

    def requests_for(self, card: ModelCard, *, seeds: Sequence[int] = (0,), prefix: str = "") -> list[Request]:
        return sample_requests(card, seeds=seeds, prefix=prefix)


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
                cls = import_object(spec.implementation)
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
            from fv_kernel.card.validate import resolve_request

            with pytest.raises(RecipeMismatch) as info:
                resolve_request(card, bad)
            assert card.recipe.method in str(info.value)


class InterleaveConformance(_CardKitBase):
    """The interleave gate (design §9.3): N concurrent requests, interleaved and batched,
    are bit-identical to the same requests run one after another."""

    concurrency: ClassVar[int] = 2
    scheduler: ClassVar[SchedulerConfig] = SchedulerConfig()

    def make_engine(self, cards: Sequence[ModelCard]) -> Engine:
        engine = Engine(self.scheduler)
        for card in cards:
            engine.add_instance(self.build(card))
        return engine

    def gate_requests(self, cards: Sequence[ModelCard], prefix: str) -> list[Request]:
        requests: list[Request] = []
        for card in cards:
            requests.extend(self.requests_for(card, seeds=range(self.concurrency), prefix=prefix))
        return requests

    def test_interleaved_equals_serial(self) -> None:
        assert self.card_ids, "set card_ids on the interleave conformance class"
        cards = [self.load_card(m) for m in self.card_ids]
        serial_engine = self.make_engine(cards)
        serial = run_serially(serial_engine, self.gate_requests(cards, "serial-"))
        engine = self.make_engine(cards)
        concurrent = run_concurrently(engine, self.gate_requests(cards, "interleaved-"))
        assert max(engine.metrics.batches_by_size) > 1, "no two requests' steps were ever batched together"
        for s, c in zip(serial, concurrent):
            assert s.status == "completed", f"serial {s.request_id}: {s.status} {s.error}"
            assert c.status == "completed", f"interleaved {c.request_id}: {c.status} {c.error}"
            assert_artifacts_identical(s.artifacts, c.artifacts, what=f"{c.request_id} interleaved vs serial")


class CachedInterleaveConformance(InterleaveConformance):
    """The interleave gate with interceptors on: N requests with caching enabled, interleaved
    and batched through the Engine, are bit-identical to the same requests run serially.

    Set :attr:`card_ids`, :attr:`interceptors` (plugin id -> class, as the deploy config's
    ``extensions:`` enables them) and :attr:`plugin_params` (what every gate request sends).
    The gate also checks that the parameters really change the output on at least one
    request (an interceptor that never fires would pass the gate vacuously), unless
    :attr:`require_effect` is False.
    """

    interceptors: ClassVar[Mapping[str, type]] = {}
    #: Deploy-time settings per plugin id (``ExtensionSettings`` fields: ``default_on``, ``config``).
    extension_settings: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    plugin_params: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    require_effect: ClassVar[bool] = True

    def make_extensions(self) -> ExtensionSet:
        assert self.interceptors, "set interceptors (plugin id -> class) on the cached interleave conformance class"
        settings = {name: dict(self.extension_settings.get(name, {})) for name in self.interceptors}
        return ExtensionSet.build(settings, dict(self.interceptors))

    def make_engine(self, cards: Sequence[ModelCard]) -> Engine:
        engine = Engine(self.scheduler, extensions=self.make_extensions())
        for card in cards:
            engine.add_instance(self.build(card))
        return engine

    def gate_requests(self, cards: Sequence[ModelCard], prefix: str) -> list[Request]:
        params = {name: dict(values) for name, values in self.plugin_params.items()}
        return [r.with_updates(plugin_params=params) for r in super().gate_requests(cards, prefix)]

    def test_interceptor_changes_the_output(self) -> None:
        if not self.require_effect:
            return
        cards = [self.load_card(m) for m in self.card_ids]
        extensions = self.make_extensions()
        changed = []
        for card in cards:
            instance = self.build(card)
            for request in self.gate_requests([card], "effect-"):
                cached = run_local(request, instance, extensions=extensions)
                plain = run_local(request.with_updates(plugin_params={}), instance)
                changed.append(any(_differs(a, b) for a, b in zip(cached, plain)))
        assert any(changed), (
            f"plugin_params {dict(self.plugin_params)} never changed an output on {list(self.card_ids)}: "
            "the interleave gate would pass without the interceptor doing anything"
        )


def _differs(a: Artifact, b: Artifact) -> bool:
    da, db = _artifact_tensors(a), _artifact_tensors(b)
    return any(isinstance(v, torch.Tensor) and not torch.equal(v, db[k]) for k, v in da.items())

