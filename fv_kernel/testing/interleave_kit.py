"""The interleave gate (design §9.3): requests interleaved and batched equal each request run alone.

``InterleaveConformance`` checks it under ``batching: exact`` (bit-identical) and ``throughput``
(within the card's ``parity.batched_vs_alone``); ``CachedInterleaveConformance`` with deploy-enabled
interceptors on. See docs/conformance.md.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, ClassVar, Literal, Mapping, NamedTuple, Sequence

import torch

from fv_kernel.cache.adapters import AdapterRegistry
from fv_kernel.card.spec import AdapterRef, ModelCard
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.model.instance import ModelInstance
from fv_kernel.model.validate import resolve_request
from fv_kernel.loop.plan import WorkKind
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.request import Request
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.engine import Engine, run_concurrently, run_serially
from fv_kernel.runtime.executor import check_promised_ops
from fv_kernel.runtime.local import run_local
from fv_kernel.runtime.records import GenerationResult
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.testing.batching import StepRecorder, run_staggered
from fv_kernel.testing.card_kit import (
    _artifact_tensors,
    _CardKitBase,
    _fixed_steps,
    alternative_size,
    assert_artifacts_identical,
)

__all__ = [
    "InterleaveConformance", "CachedInterleaveConformance", "AdapterInterleaveConformance", "AloneComparison",
    "TextDivergedWarning", "artifacts_max_abs", "compare_with_alone",
]


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
      ``parity.batched_vs_alone`` at the instance's precision (tensor artifacts within its
      ``max_abs``; generated text equal, or under ``text: may_diverge`` reported as a
      :class:`TextDivergedWarning`), no op outside the promise's ``ops`` fused, every op it names
      exists, and some step really fused. A card that declares none must come out unfused and
      bit-identical.

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
    #: The lane gate's scheduler: the decode on a second device lane (``scheduler.overlap_kinds``).
    overlap_scheduler: ClassVar[SchedulerConfig] = SchedulerConfig(batching="exact", overlap_kinds=(WorkKind.VAE_TILE,))

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


    def test_overlap_lane_equals_each_alone(self) -> None:
        """The gate requests, staggered (each arrives once the one before has run a step), with the
        ``overlap_scheduler``'s kinds on a second device lane: one request decodes on its own thread
        while another denoises, and each result is bit-identical to its run alone. Fails a card whose
        ops share state across components (a workspace its DiT and its VAE both write), which one lane
        never shows. Where the cards' requests run steps of those kinds, some batch must have run
        beside the other lane's, or the gate says so."""
        assert self.card_ids, "set card_ids on the interleave conformance class"
        cards = [self.load_card(m) for m in self.card_ids]
        requests = self.gate_requests(cards, "lane-")
        reference = self.reference_results(cards, requests)
        engine = self.make_engine(cards, self.overlap_scheduler)
        recorder = StepRecorder()
        engine.observers.append(recorder)
        got = run_staggered(engine, requests, loop_id=_stepping_loops(cards), offset=1)
        for request, ref, lane in zip(requests, reference, got):
            assert ref.status == "completed", f"alone {request.request_id}: {ref.status} {ref.error}"
            assert lane.status == "completed", f"overlap lane {request.request_id}: {lane.status} {lane.error}"
            assert_artifacts_identical(ref.artifacts, lane.artifacts,
                                       what=f"{request.request_id} with the overlap lane vs alone on a fresh instance")
        kinds = {kind.value for kind in self.overlap_scheduler.overlap_kinds}
        on_lane = {rid for record in recorder.records if record.kind in kinds for rid in record.request_ids}
        if len(on_lane) > 1:
            assert engine.metrics.overlapped_batches > 0, (
                f"no batch ran beside another on the overlap lane (kinds {sorted(kinds)}), so the gate saw no overlap"
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
                # The gate ran every task, so every op it will ever use is built: a name still unknown is a typo.
                check_promised_ops(instance, every_op_built=True)
                outside = [rec for rec in fused if not declared.covers(rec.op) and not _batch_invariant(instance, rec.op)]
                assert not outside, (f"{where}: op {outside[0].op!r} fused, but parity.batched_vs_alone covers only ops "
                                     f"{list(declared.ops)}")
                if self.throughput_must_fuse and arrivals == "concurrent":
                    assert fused, f"{where}: no step fused, so the gate saw no batched forward"
                compared = [(requests[i].request_id, compare_with_alone(reference[i].artifacts, got[i].artifacts,
                                                                        text=declared.text)) for i in mine]
                worst = max(c.max_abs for _, c in compared)
                assert worst <= declared.max_abs, (
                    f"{where}: a result moved {worst:.3g} from its run alone; the card declares "
                    f"parity.batched_vs_alone max_abs {declared.max_abs:g} ({declared.justification})"
                )
                for request_id, c in compared:
                    if c.text_differences:  # reported, not failed: the card declares text may_diverge
                        warnings.warn(f"{where}: {request_id}: generated text differs from its run alone, as "
                                      f"parity.batched_vs_alone text: may_diverge allows ({'; '.join(c.text_differences)})",
                                      TextDivergedWarning, stacklevel=2)


def _stepping_loops(cards: Sequence[ModelCard]) -> set[str]:
    """The loops whose progress spaces the staggered arrivals: the ones that run many steps."""
    return {loop_id for card in cards for loop_id, spec in card.loops.items() if spec.kind in ("diffusion_denoise", "ar_decode")}


def _batch_invariant(instance: ModelInstance, op: str) -> bool:
    return instance.op(op).batch_invariant


class TextDivergedWarning(UserWarning):
    """A request's generated text differed from its run alone under a promise whose ``text`` is
    ``may_diverge``: the throughput gate reports it and does not fail."""


class AloneComparison(NamedTuple):
    """A request's artifacts against the same request run alone (:func:`compare_with_alone`)."""

    #: The largest absolute difference over every tensor field of every artifact.
    max_abs: float
    #: The text artifacts whose text differs, described (only under ``text="may_diverge"``).
    text_differences: tuple[str, ...]


#: A text artifact's generated fields: what ``BatchedVsAlone.text`` speaks for.
_TEXT_FIELDS = frozenset({"token_ids", "text"})


def compare_with_alone(alone: Sequence[Artifact], batched: Sequence[Artifact], *,
                       text: Literal["identical", "may_diverge"] = "identical") -> AloneComparison:
    """How far ``batched`` moved from ``alone`` (one request's artifacts): every tensor field by its
    largest absolute difference; any other field (metadata, and text under ``identical``) must be
    equal, since a small difference means nothing there. Under ``may_diverge``
    (``BatchedVsAlone.text``) a text artifact's token ids and text may differ: listed in
    ``text_differences``, not asserted. A request whose text diverged had its later steps
    conditioned on other text (an upsampled prompt feeding a video step), so its tensors are not
    held to the bound: they are left out of ``max_abs``, and the listed difference says so."""
    assert len(alone) == len(batched), f"{len(alone)} artifacts vs {len(batched)}"
    tensors, differences = [], []
    for index, (a, b) in enumerate(zip(alone, batched)):
        da, db = _artifact_tensors(a), _artifact_tensors(b)
        assert da.keys() == db.keys(), f"artifact {index} fields differ"
        for key, x in da.items():
            y = db[key]
            if isinstance(x, torch.Tensor):
                assert x.shape == y.shape, f"artifact {index} ({a.kind}) field {key!r}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
                tensors.append((x, y))
            elif x != y and text == "may_diverge" and a.kind == "text" and key in _TEXT_FIELDS:
                differences.append(f"artifact {index} (text {a.name!r}) field {key!r}: alone {x!r}, batched {y!r}")
            else:
                assert x == y, f"artifact {index} ({a.kind}) field {key!r}: {x!r} != {y!r}"
    if differences:  # conditioned on other text: the tensors are not comparable
        return AloneComparison(0.0, (*differences, "tensors of a request whose text diverged are not bounded"))
    worst = max((float((x.double() - y.double()).abs().max()) for x, y in tensors if x.numel()), default=0.0)
    return AloneComparison(worst, ())


def artifacts_max_abs(left: Sequence[Artifact], right: Sequence[Artifact]) -> float:
    """The largest absolute difference between two requests' artifacts, tensor field by field;
    any other field (text, metadata) must be equal (:func:`compare_with_alone` with ``text="identical"``)."""
    return compare_with_alone(left, right).max_abs


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


class AdapterInterleaveConformance(InterleaveConformance):
    """The interleave gate with mixed adapter stacks (docs/adapters.md): the gate's varied requests
    take the stacks of :attr:`adapter_stacks` in turn, so requests of one shape that batch carry
    different stacks (or none) in one forward; each result must equal the request run alone on a
    fresh instance, bit-identically under ``batching: exact`` and within the card's
    ``batched_vs_alone`` under ``throughput``.

    Set :attr:`card_ids`, :attr:`adapter_stacks` (at least two, one of them may be empty) and
    override :meth:`adapter_registry` to return a fresh registry holding the adapters they name.
    :meth:`test_adapters_change_the_output` checks that a stack really changes an output (an
    adapter that never applies would pass the gate vacuously).
    """

    #: The stacks the gate's requests take in turn.
    adapter_stacks: ClassVar[Sequence[Sequence[AdapterRef]]] = ()

    def adapter_registry(self, cards: Sequence[ModelCard]) -> AdapterRegistry:
        raise NotImplementedError("return a fresh AdapterRegistry holding the adapters adapter_stacks names")

    def make_engine(self, cards: Sequence[ModelCard], scheduler: SchedulerConfig | None = None) -> Engine:
        registry = self.adapter_registry(cards)
        engine = Engine(scheduler or self.scheduler, adapters=registry)
        for card in cards:
            engine.add_instance(self.build(card))
            # Warm: a load's cache_io step would put its request a step behind the others, and the
            # gate's short runs would then never share a forward.
            device = engine.instances[card.model_id].device
            for info in registry.list():
                registry.load(info.version, device)
        return engine

    def gate_requests(self, cards: Sequence[ModelCard], prefix: str) -> list[Request]:
        assert len(self.adapter_stacks) >= 2, "adapter_stacks: at least two different stacks, or nothing mixes"
        requests = super().gate_requests(cards, prefix)
        return [r.with_updates(adapters=tuple(self.adapter_stacks[i % len(self.adapter_stacks)]))
                for i, r in enumerate(requests)]

    def assert_requests_vary(self, cards: Sequence[ModelCard], requests: Sequence[Request]) -> None:
        # The varied fields are checked without the stacks (resolved here without a registry).
        super().assert_requests_vary(cards, [r.with_updates(adapters=()) for r in requests])

    def test_adapters_change_the_output(self) -> None:
        cards = [self.load_card(m) for m in self.card_ids]
        stack = next((s for s in self.adapter_stacks if s), None)
        assert stack is not None, "adapter_stacks: give at least one non-empty stack"
        for card in cards:
            request = super().gate_requests([card], "effect-")[0]
            adapted, plain = run_serially(self.make_engine([card]), [request.with_updates(adapters=tuple(stack)),
                                                                     request.with_updates(request_id="effect-plain")])
            if any(_differs(a, b) for a, b in zip(adapted.raise_for_status().artifacts, plain.raise_for_status().artifacts)):
                return
        raise AssertionError(f"adapter stack {list(stack)} never changed an output on {list(self.card_ids)}")


def _differs(a: Artifact, b: Artifact) -> bool:
    da, db = _artifact_tensors(a), _artifact_tensors(b)
    return any(isinstance(v, torch.Tensor) and not torch.equal(v, db[k]) for k, v in da.items())

