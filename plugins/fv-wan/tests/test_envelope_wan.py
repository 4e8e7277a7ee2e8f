"""``wan-toy`` knows what it was trained on (issue 35): 17 frames at 64x64, 8 fps, the toy grammar's
words. A 33-frame request (the OpenAI SDK's ``seconds="4"``) or a prompt of other words used to make a
garbled or white video with exit code 0; now each is refused before any compute, naming what fits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

from fv_kernel.api import InvalidRequest, Request, TaskType, TextPart, frames_for_seconds, resolve_request
from fv_kernel.card.recipe import check_envelope
from fv_kernel.cli.app import app
from fv_wan.cards import wan_cards
from fv_wan.toy_card import wan_toy_card, weights_dir

QUICKSTART = "a red circle moves left quickly on a navy background"
DRAGON = "a purple dragon flies over a castle at sunset"
DOCS = Path(__file__).resolve().parents[3] / "docs"


@pytest.fixture(scope="module")
def toy():  # noqa: ANN201
    card = wan_toy_card()
    assert card is not None, "the wan-toy weights ship with fv-wan"
    return card


def _request(prompt: str, **diffusion: object) -> Request:
    return Request(model="wan-toy", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
                   diffusion=diffusion)  # type: ignore[arg-type]


def test_the_envelope_is_what_the_data_contract_says_it_trained_on(toy) -> None:  # noqa: ANN001
    envelope = toy.recipe.envelope
    # every stage of the recipe trained on 17-frame 64x64 clips (the trainer wrote this string)
    stages = re.findall(r"(\d+)x(\d+)x(\d+);", toy.recipe.data_contract)
    assert stages and set(stages) == {("17", "64", "64")}
    assert envelope.frames == (17,) and envelope.sizes == ((64, 64),) and envelope.fps == (8.0,)


def test_the_vocabulary_is_the_shipped_tokenizers(toy) -> None:  # noqa: ANN001
    """The reference is the tokenizer file beside the weights: the envelope's words are exactly its
    non-special tokens, and a word the envelope calls unknown is exactly one it encodes as <unk>."""
    tokenizer = Tokenizer.from_file(str(weights_dir() / "tokenizer" / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    specials = {"<pad>", "</s>", "<unk>"}
    words = toy.recipe.envelope.vocabulary
    assert set(words.words) == set(vocab) - specials
    unk = vocab["<unk>"]
    for prompt in (QUICKSTART, DRAGON, "A RED Circle moves left. on a navy background", "a red fox"):
        encoded = tokenizer.encode(prompt)
        by_tokenizer = [w for w, i in zip(prompt.split(), encoded.ids) if i == unk]
        assert words.unknown_words(prompt) == list(dict.fromkeys(by_tokenizer)), prompt


def test_the_quickstart_request_is_inside_it(toy) -> None:  # noqa: ANN001
    resolved = resolve_request(toy, _request(QUICKSTART))
    assert (resolved.diffusion.frames, resolved.diffusion.width, resolved.diffusion.height) == (17, 64, 64)
    assert check_envelope(toy, resolved) == []


def test_33_frames_and_seconds_4_are_refused_with_what_fits(toy) -> None:  # noqa: ANN001
    with pytest.raises(InvalidRequest) as frames:
        resolve_request(toy, _request(QUICKSTART, frames=33))
    assert frames.value.param == "frames" and "allowed: 17 (" in frames.value.message
    for seconds in (4, 8, 12):
        with pytest.raises(InvalidRequest) as info:
            frames_for_seconds(toy, seconds, None)
        assert info.value.param == "seconds" and "allowed: none of 4, 8, 12 (at 8 fps)" in info.value.message
    assert frames_for_seconds(toy, 4, None, allow_outside_envelope=True) == (33, 8.0)


def test_a_prompt_of_unknown_words_is_refused_and_each_unknown_word_is_reported(toy) -> None:  # noqa: ANN001
    with pytest.raises(InvalidRequest) as info:
        resolve_request(toy, _request(DRAGON))
    assert info.value.param == "prompt"
    assert "'purple', 'dragon', 'flies', 'over', 'castle', 'at', 'sunset'" in info.value.message
    assert "red" in info.value.message.split("allowed:")[1]  # the words it does know
    (warning,) = check_envelope(toy, resolve_request(toy, _request("a red dragon moves left quickly on a navy background")))
    assert "'dragon'" in warning and "<unk>" in warning


def test_cli_refuses_before_loading_weights(tmp_path: Path) -> None:
    out = tmp_path / "dragon.mp4"
    result = CliRunner().invoke(app, ["generate", "--model", "wan-toy", "--prompt", DRAGON, "-q", "--output", str(out)])
    assert result.exit_code == 2 and not out.exists()
    assert result.stderr.startswith("error: prompt: no word of it beyond")
    seconds = CliRunner().invoke(app, ["generate", "--model", "wan-toy", "--prompt", QUICKSTART, "--frames", "33", "-q",
                                       "--output", str(out)])
    assert seconds.exit_code == 2 and "error: frames: 33 frames is outside" in seconds.stderr


def test_wan21_cards_declare_81_frames_at_16_fps() -> None:
    cards = {c.model_id: c for c in wan_cards()}
    for model_id in ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p"):
        envelope = cards[model_id].recipe.envelope
        assert envelope.max_frames == 81 and envelope.fps == (16.0,) and envelope.sizes is None
        assert frames_for_seconds(cards[model_id], 4, None) == (65, 16.0)
        with pytest.raises(InvalidRequest, match=r"allowed: 4 \(at 16 fps\)"):
            frames_for_seconds(cards[model_id], 8, None)
    assert cards["wan2.2-t2v-a14b"].recipe.envelope is None  # not declared: nothing refused


def test_the_serving_docs_seconds_table_is_what_the_cards_do() -> None:
    from fv_kernel.api import CardCatalog, PluginHost

    catalog = CardCatalog(PluginHost())
    installed = catalog.entries()
    text = (DOCS / "serving.md").read_text(encoding="utf-8")
    table = text.split("<!-- seconds-table -->")[1].split("<!-- /seconds-table -->")[0]
    rows = [line for line in table.strip().splitlines()[2:]]
    assert rows
    listed = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        ids, fps, documented = re.findall(r"`([^`]+)`", cells[0]), float(cells[1]), cells[2:]
        listed.update(ids)
        for model_id in ids:
            if model_id not in installed or installed[model_id].plugin != "fv-wan":
                continue  # another plugin's cards: its own tests check its rows
            card = catalog.get(model_id)
            assert card.capabilities.defaults.fps == fps, model_id
            for seconds, doc in zip((4, 8, 12), documented):
                try:
                    frames, _ = frames_for_seconds(card, seconds, None)
                    got = f"{frames} frames"
                except InvalidRequest:
                    got = "refused"
                assert doc.split(" (")[0] == got, (model_id, seconds, doc, got)
    mine = {model_id for model_id, entry in installed.items() if entry.plugin == "fv-wan"}
    assert mine and mine <= listed, sorted(mine - listed)  # every fv-wan card has its row


def test_envelope_survives_the_card_file(toy, tmp_path: Path) -> None:  # noqa: ANN001
    """An export writes the recipe, envelope included, into fv-card.json; reading it back keeps it."""
    from fv_kernel.api import read_card_file_beside

    (tmp_path / "fv-card.json").write_text(toy.model_dump_json())
    assert json.loads((tmp_path / "fv-card.json").read_text())["recipe"]["envelope"]["frames"] == [17]
    assert read_card_file_beside(tmp_path).recipe.envelope == toy.recipe.envelope


def test_wan_toy_offers_no_images_since_one_frame_is_outside_its_envelope(toy) -> None:  # noqa: ANN001
    """Its shipped file lists text_to_image; every such request would be refused on ``frames``,
    so the card does not offer the task (and the every-card defaults gate holds for it)."""
    assert toy.capabilities.tasks == {TaskType.TEXT_TO_VIDEO}
    image = Request(model="wan-toy", task=TaskType.TEXT_TO_IMAGE, inputs=(TextPart(text=QUICKSTART),))
    with pytest.raises(InvalidRequest, match=r"^task: card 'wan-toy' cannot run 'text_to_image'"):
        resolve_request(toy, image)
