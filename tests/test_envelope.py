"""A card knows what it was trained on (``RecipeSpec.envelope``): requests outside it are refused
with the allowed values, or run with a loud warning under ``allow_outside_envelope``; the same
one validation path serves ``fv generate``, ``fv serve`` and ``fv.load().generate()``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

import fv_kernel as fv
from fv_kernel.api import EnvelopeWarning, TextVocabulary, TrainedEnvelope
from fv_kernel.card.spec import ModelCard
from fv_kernel.cli.app import app
from fv_kernel.config import DeployConfig
from fv_kernel.errors import InvalidRequest
from fv_kernel.model.instance import build_instance
from fv_kernel.model.validate import check_envelope, frames_for_seconds, resolve_request
from fv_kernel.plugins.host import PluginHost
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.serving import ServerThread, create_app
from fv_kernel.testing.toy import toy_card

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

#: toy-dit's defaults are 3 frames at 8x8, 8 fps; it was "trained" on those and these words.
ENVELOPE = TrainedEnvelope(
    frames=(3,), sizes=((8, 8),), fps=(8.0,),
    vocabulary=TextVocabulary(words=("a", "red", "circle", "moves", "left"), function_words=("a", "moves")),
)


def enveloped(envelope: TrainedEnvelope | None = ENVELOPE) -> ModelCard:
    card = toy_card("toy-dit")
    return card.model_copy(update={"recipe": card.recipe.model_copy(update={"envelope": envelope})})


def request(prompt: str = "a red circle", *, negative: str | None = None, override: bool = False, **diffusion: Any) -> Request:
    inputs = [TextPart(text=prompt)] + ([TextPart(text=negative, role="negative_prompt")] if negative else [])
    return Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=tuple(inputs),
                   diffusion=DiffusionParams(**diffusion), allow_outside_envelope=override)


# --------------------------------------------------------------------------- the spec


def test_envelope_spec_refuses_contradictions() -> None:
    with pytest.raises(ValidationError, match="not both"):
        TrainedEnvelope(frames=(17,), max_frames=33)
    with pytest.raises(ValidationError, match="envelope.sizes is empty"):
        TrainedEnvelope(sizes=())
    with pytest.raises(ValidationError, match=r"function_words \['the'\] are not in vocabulary.words"):
        TextVocabulary(words=("a",), function_words=("the",))
    # a card file carries it (JSON round trip)
    card = enveloped()
    assert ModelCard.model_validate_json(card.model_dump_json()).recipe.envelope == ENVELOPE


def test_vocabulary_splits_as_a_word_level_tokenizer() -> None:
    vocab = ENVELOPE.vocabulary
    assert vocab is not None
    assert vocab.unknown_words("A RED dragon, dragon circle.") == ["dragon,", "dragon", "circle."]
    assert vocab.content_words("a moves dragon") == []
    assert vocab.content_words("a Red thing") == ["Red"]


# --------------------------------------------------------------------------- validation


def test_inside_the_envelope_nothing_is_said() -> None:
    card = enveloped()
    resolved = resolve_request(card, request())  # the card's defaults: 3 frames, 8x8, 8 fps
    assert resolved.diffusion.frames == 3 and check_envelope(card, resolved) == []


@pytest.mark.parametrize(("diffusion", "param", "allowed"), [
    ({"frames": 5}, "frames", "allowed: 3 ("),
    ({"height": 16}, "size", "allowed: 8x8 ("),
    ({"fps": 24.0}, "fps", "allowed: 8 ("),
])
def test_outside_the_envelope_is_refused_naming_the_field_and_what_was_trained(
    diffusion: dict[str, Any], param: str, allowed: str
) -> None:
    card = enveloped()
    with pytest.raises(InvalidRequest) as info:
        resolve_request(card, request(**diffusion))
    assert info.value.param == param
    assert allowed in info.value.message and "allow_outside_envelope" in info.value.message
    assert "trained on" in info.value.message
    # the explicit override runs it, with a warning naming the field
    resolved = resolve_request(card, request(override=True, **diffusion))
    (warning,) = check_envelope(card, resolved)
    assert warning.startswith(f"{param}: ") and "allow_outside_envelope" in warning
    # an undeclared envelope refuses nothing (and says nothing)
    plain = enveloped(None)
    assert check_envelope(plain, resolve_request(plain, request(**diffusion))) == []


def test_an_undeclared_field_refuses_nothing() -> None:
    card = enveloped(TrainedEnvelope(frames=(3,)))  # sizes, fps, words not declared
    resolved = resolve_request(card, request("anything at all", height=16, fps=24.0))
    assert check_envelope(card, resolved) == []


def test_max_frames_bounds_the_frame_count() -> None:
    card = enveloped(TrainedEnvelope(max_frames=5))
    resolve_request(card, request(frames=5))
    with pytest.raises(InvalidRequest, match="allowed: <= 5"):
        resolve_request(card, request(frames=7))


def test_each_unknown_word_is_reported_and_a_prompt_with_no_known_word_is_refused() -> None:
    card = enveloped()
    resolved = resolve_request(card, request("a red dragon moves over a castle"))
    (warning,) = check_envelope(card, resolved)
    assert warning.startswith("prompt: 3 word(s) outside the vocabulary") and "<unk>" in warning
    assert "'dragon', 'over', 'castle'" in warning
    # only function words known: nothing the model can draw
    with pytest.raises(InvalidRequest) as info:
        resolve_request(card, request("a purple dragon moves over a castle"))
    assert info.value.param == "prompt"
    assert "'purple', 'dragon', 'over', 'castle'" in info.value.message
    assert "allowed: prompts made of its words: a red circle moves left" in info.value.message
    # the negative prompt reaches the same encoder
    with pytest.raises(InvalidRequest) as negative:
        resolve_request(card, request("a red circle", negative="blurry, low quality"))
    assert negative.value.param == "negative_prompt"
    # the override runs it and reports the unknown words as well
    loud = check_envelope(card, resolve_request(card, request("a purple dragon", override=True)))
    assert any("allow_outside_envelope" in w for w in loud)


def test_with_prompt_upsampling_the_rewrite_is_what_the_encoder_reads_so_words_are_not_checked() -> None:
    card = toy_card("toy-omni")
    card = card.model_copy(update={"recipe": card.recipe.model_copy(update={"envelope": ENVELOPE})})
    upsampled = Request(model="toy-omni", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a purple dragon"),),
                        prompt_upsampling=True)
    assert check_envelope(card, resolve_request(card, upsampled)) == []
    with pytest.raises(InvalidRequest, match="^prompt: "):  # the same prompt, not rewritten
        resolve_request(card, upsampled.with_updates(prompt_upsampling=False))


def test_negative_control_without_the_check_the_refusals_vanish(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug put back (validation without the envelope check): the same requests go through."""
    import fv_kernel.model.validate as validate

    monkeypatch.setattr(validate, "check_envelope", lambda card, request: [])
    card = enveloped()
    assert validate.resolve_request(card, request("a purple dragon", frames=5)).diffusion.frames == 5


# --------------------------------------------------------------------------- seconds (the OpenAI video API)


def test_seconds_map_onto_what_the_card_makes_or_are_refused_with_the_durations_that_fit() -> None:
    card = enveloped(TrainedEnvelope(frames=(33, 65), fps=(8.0,)))  # 4 s and 8 s clips at 8 fps
    assert frames_for_seconds(card, 4, None) == (33, 8.0)
    assert frames_for_seconds(card, 8, None) == (65, 8.0)
    with pytest.raises(InvalidRequest) as info:
        frames_for_seconds(card, 12, None)
    assert info.value.param == "seconds"
    assert "97 frames" in info.value.message and "allowed: 4, 8 (at 8 fps)" in info.value.message
    with pytest.raises(InvalidRequest, match=r"trained at 8 fps\); allowed: none of 4, 8, 12 \(at 16 fps\)"):
        frames_for_seconds(card, 4, 16.0)
    assert frames_for_seconds(card, 12, None, allow_outside_envelope=True) == (97, 8.0)
    # the card's own maximum still binds under the override
    capped = card.model_copy(update={"capabilities": card.capabilities.model_copy(update={"max_frames": 65})})
    with pytest.raises(InvalidRequest, match="at most 65 frames"):
        frames_for_seconds(capped, 12, None, allow_outside_envelope=True)


# --------------------------------------------------------------------------- the three surfaces


@pytest.fixture
def card_file(tmp_path: Path) -> Path:
    path = tmp_path / "toy-dit.json"
    path.write_text(enveloped().model_dump_json())
    return path


def test_facade_refuses_the_same_way_and_warns_under_the_override(card_file: Path, fv_host: PluginHost) -> None:
    gen = fv.load(str(card_file), host=fv_host)
    with pytest.raises(InvalidRequest) as info:
        gen.generate("a red circle", frames=5)
    assert info.value.param == "frames" and "allowed: 3" in info.value.message
    with pytest.raises(InvalidRequest, match="^prompt: "):
        gen.generate("a purple dragon")
    with pytest.warns(EnvelopeWarning, match="frames: 5 frames is outside"):
        video = gen.generate("a red circle", frames=5, steps=1, allow_outside_envelope=True)
    assert video.frames.shape[0] == 5
    with pytest.warns(EnvelopeWarning, match="'dragon'"):
        gen.generate("a red dragon", steps=1)


def test_facade_logs_what_it_warns(card_file: Path, fv_host: PluginHost, caplog: pytest.LogCaptureFixture) -> None:
    gen = fv.load(str(card_file), host=fv_host)
    with caplog.at_level(logging.WARNING, logger="fv.envelope"), pytest.warns(EnvelopeWarning):
        gen.request("a red circle", frames=5, allow_outside_envelope=True)
    assert any("frames: 5 frames is outside" in r.getMessage() for r in caplog.records)


def test_cli_refuses_before_any_compute_and_warns_under_the_flag(card_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.pt"
    base = ["generate", "--model", str(card_file), "--steps", "1", "-q", "--output", str(out)]
    refused = CliRunner().invoke(app, [*base, "--prompt", "a red circle", "--frames", "5"])
    assert refused.exit_code == 2 and not out.exists()
    assert refused.stderr.startswith("error: frames: 5 frames is outside") and "--allow-outside-envelope" in refused.stderr
    words = CliRunner().invoke(app, [*base, "--prompt", "a purple dragon"])
    assert words.exit_code == 2 and words.stderr.startswith("error: prompt: ")
    ran = CliRunner().invoke(app, [*base, "--prompt", "a red dragon", "--frames", "5", "--allow-outside-envelope"])
    assert ran.exit_code == 0, ran.output
    assert "warning: frames: 5 frames is outside" in ran.stderr and "warning: prompt: 1 word(s)" in ran.stderr
    assert "'dragon'" in ran.stderr and out.exists()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    deploy = DeployConfig(output_dir=tmp_path / "out")
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(enveloped(TrainedEnvelope(frames=(3,), fps=(8.0,), vocabulary=ENVELOPE.vocabulary))))
    server = ServerThread(create_app(engine, deploy)).start()
    yield server.url
    server.stop()


def test_server_refuses_seconds_frames_and_words_and_logs_under_the_override(
    served: str, caplog: pytest.LogCaptureFixture
) -> None:
    with httpx.Client(base_url=served, timeout=60.0) as client:
        # the OpenAI SDK sends seconds as a string
        seconds = client.post("/v1/videos", json={"prompt": "a red circle", "seconds": "4"})
        assert seconds.status_code == 400, seconds.text
        error = seconds.json()["error"]
        assert error["param"] == "seconds" and "allowed: none of 4, 8, 12 (at 8 fps)" in error["message"]
        frames = client.post("/v1/videos", json={"prompt": "a red circle", "frames": 5})
        assert frames.status_code == 400 and frames.json()["error"]["param"] == "frames"
        words = client.post("/v1/videos", json={"prompt": "a purple dragon"})
        assert words.status_code == 400 and words.json()["error"]["param"] == "prompt"
        with caplog.at_level(logging.WARNING, logger="fv.serving"):
            ok = client.post("/v1/videos", json={"prompt": "a red dragon", "seconds": "4", "steps": 1,
                                                 "allow_outside_envelope": True})
            assert ok.status_code == 200, ok.text
            assert ok.json()["frames"] == 33
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "frames: 33 frames is outside" in logged and "'dragon'" in logged
        # images are one frame: outside a 3-frame envelope too, and the same override runs them
        image = client.post("/v1/images/generations", json={"prompt": "a red circle", "steps": 1})
        assert image.status_code == 400 and image.json()["error"]["param"] == "frames"
        forced = client.post("/v1/images/generations", json={"prompt": "a red circle", "steps": 1,
                                                             "allow_outside_envelope": True})
        assert forced.status_code == 200, forced.text
