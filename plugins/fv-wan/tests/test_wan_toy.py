"""The shipped wan-toy card: offline weights in the package, the default model, its tokenizer, and
C1 parity of ``diffusers.WanPipeline.from_pretrained`` on the shipped directory against fv's output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fv_kernel.api import CARD_FILE, ExportError, InstanceOptions, build_instance
from fv_kernel.plugins import PluginHost
from fv_wan.export import check_parity, export_checkpoint
from fv_wan.toy.grammar import VOCABULARY
from fv_wan.toy.world import GENERATOR_VERSION
from fv_wan.toy_card import TOY_ID, TOY_INIT_ID, toy_tokenizer, wan_toy_card, wan_toy_init_card, weights_dir

MAX_SAFETENSORS_BYTES = 25 * 10**6


def test_weights_ship_in_the_package_within_25_mb() -> None:
    root = weights_dir()
    files = sorted(root.rglob("*.safetensors"))
    assert {f.parent.name for f in files} == {"transformer", "vae", "text_encoder"}
    assert sum(f.stat().st_size for f in files) <= MAX_SAFETENSORS_BYTES
    assert json.loads((root / "model_index.json").read_text())["_class_name"] == "WanPipeline"


def test_the_card_is_the_default_and_records_its_recipe() -> None:
    host = PluginHost()
    host.start()
    assert host.hooks.default_model() == TOY_ID
    card = wan_toy_card()
    assert card is not None and card.model_id == TOY_ID
    assert card.checkpoint.source == str(weights_dir()) and card.checkpoint.layout == "diffusers"
    assert card.recipe.method == "flow-matching" and card.recipe.parents == (TOY_INIT_ID,)
    assert GENERATOR_VERSION in (card.recipe.data_contract or "")
    assert host.hooks.model_cards()["fv-wan/wan-toy"].obj == card


def test_it_loads_offline_from_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    card = wan_toy_card()
    instance = build_instance(card, InstanceOptions(local_files_only=True))
    text = instance.component("text_encoder")
    assert text.model.config.d_model == 128
    # The shipped weights, not a seeded initialisation.
    init = build_instance(wan_toy_init_card()).component("transformer")
    trained = instance.component("transformer")
    assert not torch.equal(init.proj_out.weight, trained.proj_out.weight)


def test_the_tokenizer_is_word_level_and_unknown_words_are_unk() -> None:
    from transformers import AutoTokenizer

    shipped = AutoTokenizer.from_pretrained(weights_dir() / "tokenizer")
    built = toy_tokenizer()
    prompt = "a red circle moves left quickly on a navy background"
    ids = shipped(prompt).input_ids
    assert ids == built(prompt).input_ids and len(ids) == len(prompt.split()) + 1 and ids[-1] == 1  # </s>
    assert shipped.convert_ids_to_tokens(ids[:-1]) == prompt.split()
    assert shipped("a RED zebra").input_ids == [shipped.convert_tokens_to_ids("a"), shipped.convert_tokens_to_ids("red"), 2, 1]
    assert len(shipped) == 3 + len(VOCABULARY)


def test_diffusers_reproduces_fv_from_the_shipped_directory(tmp_path: Path) -> None:
    card = wan_toy_card()
    result = check_parity(card, weights_dir())
    assert result.passed, result
    # Negative control: diffusers reads the directory's own scheduler; another flow shift there moves
    # its frames far beyond the tolerance, while fv's card still runs shift 3.
    broken = tmp_path / "wan-toy"
    shutil.copytree(weights_dir(), broken)
    config = json.loads((broken / "scheduler" / "scheduler_config.json").read_text())
    (broken / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, "flow_shift": 8.0}))
    assert not check_parity(card, broken).passed


def test_export_writes_a_directory_fv_derives_the_same_computation_from(tmp_path: Path) -> None:
    """Exporting the shipped card again gives the same configs and weights (export is a pure function of the modules)."""
    card = wan_toy_card()
    out = tmp_path / "again"
    exported = export_checkpoint(card, {}, out)
    assert exported.checkpoint.source == str(out)
    for sub in ("transformer", "vae"):
        assert json.loads((out / sub / "config.json").read_text()) == json.loads((weights_dir() / sub / "config.json").read_text())
        from safetensors.torch import load_file

        a = load_file(out / sub / "diffusion_pytorch_model.safetensors")
        b = load_file(weights_dir() / sub / "diffusion_pytorch_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ExportError, match="text-to-video single-expert"):
        from fv_wan.cards import wan_cards

        export_checkpoint(next(c for c in wan_cards() if c.model_id == "wan-tiny-i2v"), {}, tmp_path / "i2v")


def test_no_model_named_means_wan_toy() -> None:
    """``fv.load()`` (and ``fv serve`` and ``fv generate`` without --model: the same hook) takes the default card: wan-toy."""
    import fv_kernel as fv

    generator = fv.load()
    assert generator.model_id == TOY_ID and generator.card == wan_toy_card()


@pytest.mark.parametrize("model_args", [["--model", TOY_ID], []], ids=["named", "default"])
def test_fv_generate_wan_toy_makes_its_default_clip(tmp_path: Path, model_args: list[str]) -> None:
    from typer.testing import CliRunner

    from fv_kernel.cli.app import app

    out = tmp_path / "demo.pt"
    result = CliRunner().invoke(app, ["generate", "--quiet", *model_args, "--prompt",
                                      "a red circle moves left quickly on a navy background", "--steps", "2", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert torch.load(out).shape == (17, 3, 64, 64)  # wan-toy's defaults (wan-tiny's are 9 x 64 x 96)


@pytest.mark.parametrize("quiet", [True, False], ids=["fv", "negative-control"])
def test_loading_writes_no_transformers_progress_bar(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, quiet: bool
) -> None:
    """fv prints one line per stage; transformers' own "Loading weights" bar (``\\r`` frames even off a
    terminal) stays off while fv-wan loads the text encoder. Without the guard, the bar is written.
    (wan-toy's pair loads without transformers, ``fv_wan.models.umt5``; here it is sent through transformers.)"""
    import contextlib

    from fv_wan.models import encoders

    monkeypatch.setattr(encoders, "load_umt5", lambda *paths: None)
    if not quiet:
        monkeypatch.setattr(encoders, "quiet_transformers_loading", contextlib.nullcontext)
    encoders.WanTextEncoder.from_pretrained(wan_toy_card().checkpoint.source)
    err = capfd.readouterr().err
    assert ("Loading weights" in err) is not quiet, err


def test_an_exported_folder_resolves_to_the_card_it_carries(tmp_path: Path) -> None:
    """``--model DIR`` (and a recipe's ``card``) on a folder an export wrote uses its ``fv-card.json``: the
    trained card with its recipe and defaults, weights from that folder -- not a card derived from the weights."""
    from fv_kernel.api import CardCatalog
    from fv_kernel.model.catalog import InvalidCardFile

    copy = tmp_path / "moved"
    shutil.copytree(weights_dir(), copy)
    resolved = CardCatalog(PluginHost()).resolve(str(copy))
    assert resolved.card.model_id == TOY_ID and resolved.card.recipe.method == "flow-matching"
    assert resolved.source == str(copy) and resolved.card.checkpoint.source == str(copy)
    # Control: without the card file the same folder is only a WanPipeline checkpoint, and gets a derived card.
    (copy / CARD_FILE).unlink()
    derived = CardCatalog(PluginHost()).resolve(str(copy)).card
    assert derived.model_id != TOY_ID and derived.recipe.method == "base"
    (copy / CARD_FILE).write_text(json.dumps({**json.loads((weights_dir() / CARD_FILE).read_text()), "family": 7}))
    with pytest.raises(InvalidCardFile, match="family"):
        CardCatalog(PluginHost()).resolve(str(copy))
