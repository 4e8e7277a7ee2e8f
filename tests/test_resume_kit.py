"""The resume kit proves itself: loops that keep what they need outside their state pass an
in-process save/restore but fail the fresh-process check; a UniPC state that loses part of its
history when written fails it too, even from a class that shortens steps; unserializable state
fails when written."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_kernel.card.spec import ModelCard, SamplerBinding
from fv_kernel.loop.plan import StepResult
from fv_kernel.model.instance import build_instance
from fv_kernel.model.validate import resolve_request
from fv_kernel.state import StateNotSerializable
from fv_kernel.runtime.local import run_local
from fv_kernel.testing import ResumeConformance
from fv_kernel.testing.card_kit import assert_artifacts_identical, roundtrip_state
from fv_kernel.testing.toy import DenoiseState, ToyDenoiseLoop, toy_card


# One intra-op thread in this process and in the fresh ones it starts (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class RngOnLoopDenoise(ToyDenoiseLoop):
    """The bug the kit exists to catch: an RNG kept on the loop object instead of in the state.

    One uninterrupted run is deterministic (and so is a save/restore inside the process),
    but a fresh process starts the generator over."""

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self._generators: dict[str, torch.Generator] = {}

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        state = super().advance(state, result)
        generator = self._generators.setdefault(state.request_id, torch.Generator().manual_seed(7))
        jitter = 1e-3 * torch.randn(state.latents.shape, generator=generator)
        return state.model_copy(update={"latents": state.latents + jitter})


class GeneratorInStateDenoise(ToyDenoiseLoop):
    """A state holding a torch.Generator object (not its state tensor)."""

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        state = super().advance(state, result)
        return state.model_copy(update={"plugin_state": {"x": {"cond": torch.Generator()}}})


class _LossyUniPCState(DenoiseState):
    """A toy denoise state whose written form loses part of UniPC's history (the bugs below);
    in memory, and so in an uninterrupted run, the state is whole."""

    def lose(self, sampler_state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _payload(self) -> dict[str, Any]:
        payload = super()._payload()
        self.lose(payload["data"]["sampler_state"])  # plain dicts; the live tensors are not touched
        return payload


class NoLastSampleState(_LossyUniPCState):
    """The issue's bug: UniPC's ``last_sample`` (the corrector's input) is not serialized."""

    def lose(self, sampler_state: dict[str, Any]) -> None:
        sampler_state.pop("last_sample")  # reads back as None: the corrector is skipped


class OldHistoryInBf16State(_LossyUniPCState):
    """Written with every x0 prediction but the newest rounded to bf16 ("older history is only a
    correction term"). Only the corrector of a full-order step reads it, and the last step's
    corrector does not change the output: at 3 steps every checkpoint resumes bit-identically."""

    def lose(self, sampler_state: dict[str, Any]) -> None:
        outputs = sampler_state["model_outputs"]
        sampler_state["model_outputs"] = [t.to(torch.bfloat16).to(t.dtype) for t in outputs[:-1]] + outputs[-1:]


class _LossyDenoise(ToyDenoiseLoop):
    def init(self, request: Any, model: Any, ctx: Any) -> DenoiseState:
        return self.state_type.model_validate(dict(super().init(request, model, ctx)))


class NoLastSampleDenoise(_LossyDenoise):
    state_type = NoLastSampleState


class OldHistoryInBf16Denoise(_LossyDenoise):
    state_type = OldHistoryInBf16State


UNIPC = SamplerBinding(name="unipc", config={"shift": 3.0})


def _toy_dit_with(loop_class: type | None, loop_id: str = "denoise", sampler: SamplerBinding | None = None) -> ModelCard:
    """toy-dit with one loop's class (and sampler) replaced; its loops: denoise (Euler), denoise_unipc."""
    card = toy_card("toy-dit")
    update: dict[str, Any] = {"implementation": f"{__name__}:{loop_class.__name__}"} if loop_class else {}
    if sampler is not None:
        update["sampler"] = sampler
    spec = card.loops[loop_id].model_copy(update=update)
    return card.model_copy(update={"loops": {**card.loops, loop_id: spec}})


class RngOnLoopKit(ResumeConformance):
    card_ids = ("toy-dit",)

    def load_card(self, model_id: str) -> ModelCard:
        return _toy_dit_with(RngOnLoopDenoise)


class GeneratorInStateKit(ResumeConformance):
    card_ids = ("toy-dit",)

    def load_card(self, model_id: str) -> ModelCard:
        return _toy_dit_with(GeneratorInStateDenoise)


class _ThreeSteps:
    steps = 3  # what fv-wan's conformance classes set to keep their suite fast


class NoLastSampleKit(_ThreeSteps, ResumeConformance):
    card_ids = ("toy-dit",)

    def load_card(self, model_id: str) -> ModelCard:
        # In the second UniPC loop, which no default request runs: the kit adds one.
        return _toy_dit_with(NoLastSampleDenoise, "denoise_unipc")


class OldHistoryInBf16Kit(_ThreeSteps, ResumeConformance):
    card_ids = ("toy-dit",)

    def load_card(self, model_id: str) -> ModelCard:
        return _toy_dit_with(OldHistoryInBf16Denoise, sampler=UNIPC)  # the default loop, as on wan cards


class OldHistoryInBf16AtThreeStepsKit(OldHistoryInBf16Kit):
    """The same kit with the step raise taken out: the requests run the class's 3 steps."""

    def long_enough(self, card: ModelCard, requests: Any) -> list[Any]:
        return list(requests)


def test_a_unipc_state_that_drops_last_sample_when_written_fails_the_kit() -> None:
    # Every checkpoint resumes, so the ones where the corrector still matters (steps 1 and 2 of
    # the raised 4) are among them; the one in the middle of 3 steps (step 2) was the last step.
    with pytest.raises(AssertionError, match=r"toy-dit resume-unipc-toy-dit-\S+ resumed from 'denoise_unipc at step [12]' "
                                             r"in a fresh process: artifact 0 \(video\) field 'frames' differs"):
        NoLastSampleKit().check_cards(["toy-dit"])


def test_a_unipc_history_that_is_only_read_from_four_steps_on_fails_a_three_step_kit() -> None:
    OldHistoryInBf16AtThreeStepsKit().check_cards(["toy-dit"])  # 3 steps: no checkpoint notices
    with pytest.raises(AssertionError, match=r"resumed from 'denoise at step 2' in a fresh process: artifact 0 \(video\) "
                                             r"field 'frames' differs"):
        OldHistoryInBf16Kit().check_cards(["toy-dit"])  # raised to UniPC's 4 steps: step 2 of 4 reads it


def test_the_kit_lengthens_short_multistep_trajectories_and_runs_every_multistep_loop() -> None:
    kit = NoLastSampleKit()

    def plan(card: ModelCard) -> list[tuple[str | None, int | None]]:
        return [(r.diffusion.sampler, resolve_request(card, r).diffusion.steps)
                for r in kit.long_enough(card, kit.resume_requests(card))]

    # Euler (memoryless) keeps the class's 3 steps; the UniPC loop no request runs gets one at 4.
    assert plan(toy_card("toy-dit")) == [(None, 3), (None, 3), ("unipc", 4)]
    # UniPC as the default loop: every request raised to 4, nothing added.
    assert plan(_toy_dit_with(None, sampler=UNIPC)) == [(None, 4), (None, 4)]
    # Order 3 needs 5; a recipe's fixed steps are never changed.
    order_3 = UNIPC.model_copy(update={"config": {"shift": 3.0, "solver_order": 3}})
    assert plan(_toy_dit_with(None, sampler=order_3)) == [(None, 5), (None, 5)]
    fixed = _toy_dit_with(None, sampler=UNIPC.model_copy(update={"fixed_steps": 3}))
    assert [r.diffusion.steps for r in kit.long_enough(fixed, kit.resume_requests(fixed))] == [None, None]
    # A card that cannot take the steps is a clear failure, not a silent skip.
    card = _toy_dit_with(None, sampler=UNIPC)
    defaults = card.capabilities.defaults
    assert defaults is not None
    capabilities = card.capabilities.model_copy(update={"max_steps": 3, "defaults": defaults.model_copy(update={"steps": 3})})
    capped = card.model_copy(update={"capabilities": capabilities})
    with pytest.raises(AssertionError, match="sampler 'unipc' needs 4 denoise steps for its history to matter after a "
                                             "checkpoint, but the card allows at most 3"):
        kit.long_enough(capped, kit.resume_requests(capped))
    # A multistep loop the kit cannot build a request for (no task it knows) is named, not skipped.
    from fv_kernel.request.types import TaskType

    program = card.programs[TaskType.TEXT_TO_VIDEO]
    policy_only = card.model_copy(update={
        "capabilities": card.capabilities.model_copy(update={"tasks": frozenset({TaskType.ACTION_POLICY})}),
        "programs": {TaskType.ACTION_POLICY: program},
    })
    with pytest.raises(AssertionError, match="toy-dit: denoise loop 'denoise' binds the multistep sampler 'unipc', whose "
                                             "history a resume must carry, but no resume request runs it"):
        kit.long_enough(policy_only, kit.resume_requests(policy_only))


def test_every_step_index_of_every_loop_resumes_latest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from fv_kernel.testing import resume_kit

    jobs: list[Any] = []
    monkeypatch.setattr(resume_kit, "resume_in_fresh_process", lambda kit, batch, **_: jobs.extend(batch) or [])
    NoLastSampleKit().check_cards(["toy-dit"])  # nothing resumes: only the jobs it would send are kept
    by_request: dict[str, list[str]] = {}
    for _, point in jobs:
        by_request.setdefault(point.request_id, []).append(point.position)
    # The raised UniPC request (3 -> 4 steps): each request from its last checkpoint to its first,
    # so no resume follows one that already ran the steps before its checkpoint.
    assert by_request["resume-unipc-toy-dit-text_to_image-8x8-0"] == [
        "decode at step 1", *(f"denoise_unipc at step {i}" for i in (4, 3, 2, 1)), "text_encode at step 1",
    ]
    assert by_request["resume-toy-dit-text_to_video-8x8-0"][:3] == ["decode at step 3", "decode at step 2", "decode at step 1"]


def test_an_rng_on_the_loop_object_passes_in_process_but_fails_the_fresh_process_check() -> None:
    card = _toy_dit_with(RngOnLoopDenoise)
    request = RngOnLoopKit().resume_requests(card)[0]
    # What the in-process check sees: the loop object (and its RNG) survives the round trip.
    plain = run_local(request, build_instance(card))
    assert_artifacts_identical(plain, run_local(request, build_instance(card), on_state=roundtrip_state), what="in process")
    with pytest.raises(AssertionError, match=r"toy-dit resume-toy-dit-\S+ resumed from 'denoise at step \d' in a fresh process: "
                                             r"artifact 0 \(video\) field 'frames' differs"):
        RngOnLoopKit().check_cards(["toy-dit"])


def test_unserializable_state_fails_the_kit_when_written_naming_loop_and_field() -> None:
    with pytest.raises(StateNotSerializable, match=r"DenoiseState\.plugin_state\['x'\]\['cond'\] \(loop 'denoise'\)"):
        GeneratorInStateKit().check_cards(["toy-dit"])


def test_a_kit_class_the_fresh_process_cannot_import_is_refused() -> None:
    class Local(ResumeConformance):
        card_ids = ("toy-dit",)

        def load_card(self, model_id: str) -> ModelCard:
            return toy_card(model_id)

    with pytest.raises(AssertionError, match="must be defined at module level"):
        Local().check_cards(["toy-dit"])


class TestFakePoolResume(ResumeConformance):
    """The scheduler simulation's fake cards are cards too: their loops resume in a fresh process."""

    card_ids = ("fake-video", "fake-ar")

    def load_card(self, model_id: str) -> ModelCard:
        from fv_kernel.testing.fake_pool import fake_card

        return fake_card(model_id, loop_kind="ar_decode" if model_id == "fake-ar" else "diffusion_denoise", step_seconds=0.0)


def _load_example(name: str) -> Any:
    """A docs/examples module under the name its card's import strings use (as when it runs as a script)."""
    import importlib.util
    import sys
    from pathlib import Path

    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "docs" / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class TestExampleCardsResume(ResumeConformance):
    """The docs' example cards (minimal_card.py, video_card_plugin.py) resume in a fresh process too."""

    card_ids = ("demo-tiny", "tinyvideo")

    def load_card(self, model_id: str) -> ModelCard:
        module = {"demo-tiny": "minimal_card", "tinyvideo": "video_card_plugin"}[model_id]
        return _load_example(module).CARD
