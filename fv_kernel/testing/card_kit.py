"""Card, loop and interleave conformance: base classes a model plugin subclasses.

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
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Mapping, Sequence

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
from fv_kernel.runtime.engine import Engine, run_concurrently, run_serially
from fv_kernel.runtime.records import GenerationResult
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.testing.batching import StepRecorder, run_staggered
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.runtime.local import run_local

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.plugins.host import PluginHost
    from fv_kernel.plugins.registry import DeployRegistry

__all__ = [
    "CardConformance",
    "InterleaveConformance",
    "CachedInterleaveConformance",
    "sample_requests",
    "alternative_size",
    "GATE_PROMPTS",
    "GATE_NEGATIVE_PROMPTS",
    "SIZE_SEED_OFFSET",
    "assert_artifacts_identical",
    "artifacts_max_abs",
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
_GENERATING_KINDS = frozenset({"diffusion_step", "diffusion_window", "chunk_step", "ar_token"})

def _diffusion(request: Request) -> bool:
    return request.task is not TaskType.TEXT_GENERATION


def _other_size(card: ModelCard, request: Request) -> str | None:
    size, d = alternative_size(card), card.capabilities.defaults
    if not _diffusion(request) or size is None or d is None:
        return None
    return f"it accepts {size[0]}x{size[1]} besides its default {d.height}x{d.width}"


def _free_steps(card: ModelCard, request: Request) -> str | None:
    if not _diffusion(request) or card.capabilities.defaults is None or _fixed_steps(card, request) is not None:
        return None
    return "its recipe does not fix them"


def _cfg_default(name: str) -> Callable[[ModelCard, Request], str | None]:
    def why(card: ModelCard, request: Request) -> str | None:
        value = getattr(card.capabilities.defaults, name, None)
        if not _diffusion(request) or not card.capabilities.uses_guidance or value is None or value <= 1.0:
            return None
        return f"its default {name} {value:g} runs classifier-free guidance"

    return why


def _negative_branch(card: ModelCard, request: Request) -> str | None:
    guidance = request.diffusion.guidance
    if not _diffusion(request) or not card.capabilities.uses_guidance or guidance is None or guidance <= 1.0:
        return None
    return "the request runs classifier-free guidance, whose unconditional branch reads it"


#: Request fields the gate requires to differ between a card's gate requests of one task, decided
#: from the card alone (never from :func:`sample_requests`, which builds the gate's requests: a kit
#: that stopped varying a field must not also stop checking it): (name, value of a resolved request,
#: why the card lets it vary for that request, or None where it does not).
_VARIED_FIELDS: tuple[tuple[str, Callable[[Request], Any], Callable[[ModelCard, Request], str | None]], ...] = (
    ("prompt", lambda r: r.text("prompt"), lambda card, r: "every request brings its own"),
    ("negative prompt", lambda r: r.text("negative_prompt"), _negative_branch),
    ("seed", lambda r: r.diffusion.seed if _diffusion(r) else r.ar.seed if r.ar is not None else None,
     lambda card, r: "every request brings its own"),
    ("size", lambda r: (r.diffusion.height, r.diffusion.width), _other_size),
    ("steps", lambda r: r.diffusion.steps, _free_steps),
    ("guidance", lambda r: r.diffusion.guidance, _cfg_default("guidance")),
    ("guidance_2", lambda r: r.diffusion.guidance_2, _cfg_default("guidance_2")),
    ("max_tokens", lambda r: r.ar.max_tokens if r.ar is not None else None,
     lambda card, r: None if _diffusion(r) else "every text request sets its own length"),
)


class InterleaveConformance(_CardKitBase):
    """The interleave gate (design §9.3), in both batching modes.

    Requests that differ in everything a card lets vary run through one Engine with one
    instance per card, and each is compared with the same request run alone on a fresh
    instance built from the same card:

    - **exact** (:meth:`test_interleaved_equals_each_alone`): run concurrently (interleaved and
      batched), each result is bit-identical to its run alone;
    - **throughput** (:meth:`test_throughput_within_the_card_tolerance`): run concurrently and
      staggered (each next request arrives once the one before it has run a step, so fused
      forwards hold rows at different timesteps), each result is within the card's declared
      ``parity.batched_vs_alone`` at the instance's precision, and some step really fused. A card
      that declares none must come out unfused and bit-identical.

    The fresh-instance reference matters: run serially on one shared instance, state a model
    keeps on its modules or a loop keeps on itself leaks from one request into the next in the
    reference too, and the gate would compare a smear with a smear. The varied requests matter:
    with one prompt for all, a smeared conditioning is the right conditioning.
    """

    #: Requests per task and size (each shape gets this many, so they can batch); at most 4.
    concurrency: ClassVar[int] = 2
    #: The exact gate's scheduler, and the reference's.
    scheduler: ClassVar[SchedulerConfig] = SchedulerConfig(batching="exact")
    #: The throughput gate's (model code inline on the event loop: arrivals land between steps, deterministically).
    throughput_scheduler: ClassVar[SchedulerConfig] = SchedulerConfig(batching="throughput", device_thread=False)
    #: Whether the throughput gate needs some step of a declaring card to have fused (False only where
    #: every step runs per sample regardless, e.g. block interceptors carrying per-request state).
    throughput_must_fuse: ClassVar[bool] = True

    def make_engine(self, cards: Sequence[ModelCard], scheduler: SchedulerConfig | None = None) -> Engine:
        engine = Engine(scheduler or self.scheduler)
        for card in cards:
            engine.add_instance(self.build(card))
        return engine

    def gate_requests(self, cards: Sequence[ModelCard], prefix: str) -> list[Request]:
        requests: list[Request] = []
        for card in cards:
            requests.extend(self.requests_for(card, seeds=range(self.concurrency), prefix=prefix, vary_size=True))
        return requests

    def reference_results(self, cards: Sequence[ModelCard], requests: Sequence[Request]) -> list[GenerationResult]:
        """Each request alone, through an Engine of its own on a fresh instance of its card."""
        by_id = {card.model_id: card for card in cards}
        return [run_serially(self.make_engine([by_id[r.model]]), [r])[0] for r in requests]

    def assert_requests_vary(self, cards: Sequence[ModelCard], requests: Sequence[Request]) -> None:
        """Within each task, a card's gate requests differ in every field the card lets vary
        (:data:`_VARIED_FIELDS`: prompt and seed always; negative prompt, size, steps, guidance
        and text length where the card takes them)."""
        for card in cards:
            mine = [resolve_request(card, r) for r in requests if r.model == card.model_id]
            for task in sorted({r.task for r in mine}, key=lambda t: t.value):
                group = [r for r in mine if r.task is task]
                for name, value_of, why in _VARIED_FIELDS:
                    reasons = {r.request_id: why(card, r) for r in group}
                    free = [r for r in group if reasons[r.request_id] is not None]
                    values = {value_of(r) for r in free}
                    if len(free) < 2 or len(values) > 1:
                        continue
                    raise AssertionError(
                        f"{card.model_id}: every {task.value} gate request has the same {name} ({sorted(values, key=repr)}), "
                        f"but the card lets it vary ({reasons[free[0].request_id]}) and a request that leaks its {name} "
                        "into another would pass unnoticed. If requests_for overwrites it (e.g. diffusion.steps to "
                        "shorten the suite), set the class attribute instead (steps = N) or keep two values"
                    )

    def test_interleaved_equals_each_alone(self) -> None:
        assert self.card_ids, "set card_ids on the interleave conformance class"
        assert self.concurrency >= 2, "concurrency: at least 2 requests per shape, or nothing can batch"
        cards = [self.load_card(m) for m in self.card_ids]
        requests = self.gate_requests(cards, "gate-")
        assert len({r.request_id for r in requests}) == len(requests), "gate request ids must be unique"
        self.assert_requests_vary(cards, requests)
        reference = self.reference_results(cards, requests)
        engine = self.make_engine(cards)
        recorder = StepRecorder()
        engine.observers.append(recorder)
        interleaved = run_concurrently(engine, requests)
        loops = {engine.instances[c.model_id].instance_id: c.loops for c in cards}
        generating = [
            r for r in recorder.records
            if r.kind in _GENERATING_KINDS and loops[r.instance_id][r.loop_id].batchable
        ]
        ran = {rid for record in generating for rid in record.request_ids}
        batched = {rid for record in generating if record.batch_size > 1 for rid in record.request_ids}
        alone = [r.request_id for r in requests if r.request_id in ran and r.request_id not in batched]
        assert not alone, (
            f"{alone} never ran a denoise or token step batched with another request: the gate needs every "
            "request to share a shape with another one (requests_for builds len(seeds) requests per task and size)"
        )
        for request, ref, got in zip(requests, reference, interleaved):
            assert ref.status == "completed", f"alone {request.request_id}: {ref.status} {ref.error}"
            assert got.status == "completed", f"interleaved {request.request_id}: {got.status} {got.error}"
            assert_artifacts_identical(
                ref.artifacts, got.artifacts, what=f"{request.request_id} interleaved vs alone on a fresh instance"
            )


    def test_throughput_within_the_card_tolerance(self) -> None:
        assert self.card_ids, "set card_ids on the interleave conformance class"
        cards = [self.load_card(m) for m in self.card_ids]
        requests = self.gate_requests(cards, "tgate-")
        reference = self.reference_results(cards, requests)
        for arrivals in ("concurrent", "staggered"):
            engine = self.make_engine(cards, self.throughput_scheduler)
            recorder = StepRecorder()
            engine.observers.append(recorder)
            if arrivals == "concurrent":
                got = run_concurrently(engine, requests)
            else:
                got = run_staggered(engine, requests, loop_id=_stepping_loops(cards), offset=1)
            for card in cards:
                instance = engine.instances[card.model_id]
                mine = [i for i, r in enumerate(requests) if r.model == card.model_id]
                fused = [rec for rec in recorder.records if rec.instance_id == instance.instance_id and sum(rec.fused) > 1]
                declared = card.parity.batching_tolerance(instance.precision)
                where = f"{card.model_id} at {instance.precision}, {arrivals} arrivals under batching: throughput"
                for i in mine:
                    assert reference[i].status == "completed", f"alone {requests[i].request_id}: {reference[i].error}"
                    assert got[i].status == "completed", f"{where}: {requests[i].request_id}: {got[i].error}"
                if declared is None:
                    unfused = [rec for rec in fused if not _batch_invariant(instance, rec.op)]
                    assert not unfused, f"{where}: declares no parity.batched_vs_alone, yet op {unfused[0].op!r} fused"
                    for i in mine:
                        assert_artifacts_identical(reference[i].artifacts, got[i].artifacts,
                                                   what=f"{where}: {requests[i].request_id}")
                    continue
                if self.throughput_must_fuse and arrivals == "concurrent":
                    assert fused, f"{where}: no step fused, so the gate saw no batched forward"
                worst = max(artifacts_max_abs(reference[i].artifacts, got[i].artifacts) for i in mine)
                assert worst <= declared.max_abs, (
                    f"{where}: a result moved {worst:.3g} from its run alone; the card declares "
                    f"parity.batched_vs_alone max_abs {declared.max_abs:g} ({declared.justification})"
                )


def _stepping_loops(cards: Sequence[ModelCard]) -> set[str]:
    """The loops whose progress spaces the staggered arrivals: the ones that run many steps."""
    return {loop_id for card in cards for loop_id, spec in card.loops.items() if spec.kind in ("diffusion_denoise", "ar_decode")}


def _batch_invariant(instance: ModelInstance, op: str) -> bool:
    return instance.op(op).batch_invariant


def artifacts_max_abs(left: Sequence[Artifact], right: Sequence[Artifact]) -> float:
    """The largest absolute difference between two requests' artifacts, tensor field by field;
    any other field (text, metadata) must be equal, since a small difference means nothing there."""
    assert len(left) == len(right), f"{len(left)} artifacts vs {len(right)}"
    worst = 0.0
    for index, (a, b) in enumerate(zip(left, right)):
        da, db = _artifact_tensors(a), _artifact_tensors(b)
        assert da.keys() == db.keys(), f"artifact {index} fields differ"
        for key, x in da.items():
            y = db[key]
            if isinstance(x, torch.Tensor):
                assert x.shape == y.shape, f"artifact {index} ({a.kind}) field {key!r}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
                if x.numel():
                    worst = max(worst, float((x.double() - y.double()).abs().max()))
            else:
                assert x == y, f"artifact {index} ({a.kind}) field {key!r}: {x!r} != {y!r}"
    return worst


class CachedInterleaveConformance(InterleaveConformance):
    """The interleave gate with interceptors on: the gate's varied requests with caching enabled,
    interleaved and batched through the Engine, are bit-identical to each request run alone on
    a fresh instance with fresh interceptors.

    Set :attr:`card_ids`, :attr:`interceptors` (plugin id -> class, as the deploy config's
    ``extensions:`` enables them) and :attr:`plugin_params` (what every gate request sends).
    The gate also checks that the parameters really change the output on at least one
    request (an interceptor that never fires would pass the gate vacuously), unless
    :attr:`require_effect` is False.
    """

    #: Block interceptors carry per-request state, so their steps never fuse.
    throughput_must_fuse: ClassVar[bool] = False
    interceptors: ClassVar[Mapping[str, type]] = {}
    #: Deploy-time settings per plugin id (``ExtensionSettings`` fields: ``default_on``, ``config``).
    extension_settings: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    plugin_params: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    require_effect: ClassVar[bool] = True

    def make_extensions(self) -> ExtensionSet:
        assert self.interceptors, "set interceptors (plugin id -> class) on the cached interleave conformance class"
        settings = {name: dict(self.extension_settings.get(name, {})) for name in self.interceptors}
        return ExtensionSet.build(settings, dict(self.interceptors))

    def make_engine(self, cards: Sequence[ModelCard], scheduler: SchedulerConfig | None = None) -> Engine:
        engine = Engine(scheduler or self.scheduler, extensions=self.make_extensions())
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
        for card in cards:
            instance = self.build(card)
            for request in self.gate_requests([card], "effect-"):
                cached = run_local(request, instance, extensions=extensions)
                plain = run_local(request.with_updates(plugin_params={}), instance)
                if any(_differs(a, b) for a, b in zip(cached, plain)):
                    return  # one changed output is the proof; the rest would only cost time
        raise AssertionError(
            f"plugin_params {dict(self.plugin_params)} never changed an output on {list(self.card_ids)}: "
            "the interleave gate would pass without the interceptor doing anything"
        )


def _differs(a: Artifact, b: Artifact) -> bool:
    da, db = _artifact_tensors(a), _artifact_tensors(b)
    return any(isinstance(v, torch.Tensor) and not torch.equal(v, db[k]) for k, v in da.items())

