"""The resume kit proves itself: loops that keep what they need outside their state pass an
in-process save/restore but fail the fresh-process check; unserializable state fails when written."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_kernel.card.spec import ModelCard
from fv_kernel.loop.plan import StepResult
from fv_kernel.state import StateNotSerializable
from fv_kernel.model.instance import build_instance
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


def _toy_dit_with(loop_class: type) -> ModelCard:
    card = toy_card("toy-dit")
    spec = card.loops["denoise"].model_copy(update={"implementation": f"{__name__}:{loop_class.__name__}"})
    return card.model_copy(update={"loops": {**card.loops, "denoise": spec}})


class RngOnLoopKit(ResumeConformance):
    card_ids = ("toy-dit",)

    def load_card(self, model_id: str) -> ModelCard:
        return _toy_dit_with(RngOnLoopDenoise)


class GeneratorInStateKit(ResumeConformance):
    card_ids = ("toy-dit",)

    def load_card(self, model_id: str) -> ModelCard:
        return _toy_dit_with(GeneratorInStateDenoise)


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
