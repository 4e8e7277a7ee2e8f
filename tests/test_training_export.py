"""fv_kernel.training: the export keeps a directory only when the family's parity check passes;
recipe files name their bad fields; fv train refuses an unknown method. A fake family plugin
stands in for a model family (the kernel names none)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fv_kernel.api import ExportError, ModelCard, ParityResult, RecipeError, RecipeSpec, hookimpl
from fv_kernel.plugins import PluginHost
from fv_kernel.testing.toy import toy_card
from fv_kernel.training.recipe import load_recipe
from fv_kernel.training.runner import export_model, read_card_file_beside


class _Family:
    """Exports toy cards as one JSON file; its parity check reports ``measured`` against 1e-5."""

    def __init__(self, measured: float) -> None:
        self.measured = measured

    @hookimpl
    def fv_export_checkpoint(self, card: ModelCard, modules: dict, directory: Path) -> ModelCard | None:
        if card.family != "toy":
            return None
        directory.mkdir(parents=True)
        (directory / "weights.json").write_text(json.dumps(sorted(modules)))
        return card.model_copy(update={"checkpoint": card.checkpoint.model_copy(update={"source": str(directory)})})

    @hookimpl
    def fv_check_parity(self, card: ModelCard, directory: Path) -> ParityResult | None:
        assert (directory / "weights.json").is_file()  # it checks the exported directory, before it is kept
        return ParityResult("reference==1", "loop_vs_reference", "max_abs", self.measured, 1e-5)


def _host(*plugins: object) -> PluginHost:
    host = PluginHost(discover=False)
    for i, plugin in enumerate(plugins):
        host.register(plugin, name=f"family-{i}")
    host.start()
    return host


def test_a_passing_export_is_kept_with_the_trained_card_beside_it(tmp_path: Path) -> None:
    card = toy_card("toy-dit")
    out = tmp_path / "export"
    recipe = RecipeSpec(method="flow-matching", parents=("toy-dit",), data_contract="toy data v1, seed 0")
    exported, parity = export_model(card, {"dit": object()}, out, _host(_Family(1e-7)), model_id="toy-trained", recipe=recipe)
    assert parity.passed and exported.model_id == "toy-trained" and exported.recipe == recipe
    assert json.loads((out / "weights.json").read_text()) == ["dit"]
    assert not (tmp_path / "export.unchecked").exists()
    moved = tmp_path / "moved"
    out.rename(moved)
    again = read_card_file_beside(moved)
    assert again.checkpoint.source == str(moved) and again.recipe == recipe


class _CheckedCard(_Family):
    """Records the card its parity check was given (serve_as must not change what is checked)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.checked: list[ModelCard] = []

    @hookimpl
    def fv_check_parity(self, card: ModelCard, directory: Path) -> ParityResult | None:
        self.checked.append(card)
        return super().fv_check_parity(card, directory)


def test_serve_as_writes_the_serving_card_after_checking_the_export(tmp_path: Path) -> None:
    card, out, family = toy_card("toy-dit"), tmp_path / "export", _CheckedCard()

    def causal(exported: ModelCard) -> ModelCard:  # stands in for a family's causal card builder
        return exported.model_copy(update={"summary": "served by its chunk rollout"})

    exported, _ = export_model(card, {"dit": object()}, out, _host(family), model_id="toy-trained", serve_as=causal)
    assert [c.summary for c in family.checked] == [card.summary]  # checked as exported
    assert exported.summary == "served by its chunk rollout" and exported.checkpoint.source == str(out.resolve())
    assert read_card_file_beside(out).summary == "served by its chunk rollout"  # the card written beside the weights


def test_an_invalid_serve_as_card_is_an_export_error(tmp_path: Path) -> None:
    def broken(exported: ModelCard) -> ModelCard:
        programs = {task: spec.model_copy(update={"loops": ("no-such-loop",)}) for task, spec in exported.programs.items()}
        return exported.model_copy(update={"programs": programs})

    with pytest.raises(ExportError, match="serve_as card for 'toy-dit' is invalid"):
        export_model(toy_card("toy-dit"), {}, tmp_path / "export", _host(_Family(0.0)), serve_as=broken)
    assert not (tmp_path / "export").exists()


def test_a_failing_parity_check_refuses_the_export(tmp_path: Path) -> None:
    """The gate's negative control: the same export with a measured difference over the tolerance."""
    out = tmp_path / "export"
    with pytest.raises(ExportError, match=r"parity check failed: max_abs 0\.01 > 1e-05 .*unchecked export is at"):
        export_model(toy_card("toy-dit"), {}, out, _host(_Family(1e-2)))
    assert not out.exists() and (tmp_path / "export.unchecked" / "weights.json").is_file()


def test_no_family_plugin_no_export(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no enabled plugin exports cards of family 'toy'"):
        export_model(toy_card("toy-dit"), {}, tmp_path / "x", _host())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("not an export")
    with pytest.raises(ExportError, match="is not an earlier export"):
        export_model(toy_card("toy-dit"), {}, tmp_path / "other", _host(_Family(0.0)))
    assert (tmp_path / "other" / "keep.txt").is_file()


def test_recipe_files_name_the_bad_field(tmp_path: Path) -> None:
    bad = tmp_path / "r.yaml"
    bad.write_text("method: m\ncard: c\noutput_model_id: ok\nseed: -1\n")
    with pytest.raises(RecipeError, match=r"^seed: Input should be greater than or equal to 0"):
        load_recipe(bad)
    bad.write_text("[1, 2]\n")
    with pytest.raises(RecipeError, match="holds a list, not a mapping"):
        load_recipe(bad)
    bad = tmp_path / "r.json"
    bad.write_text("{")
    with pytest.raises(RecipeError, match="is not valid JSON"):
        load_recipe(bad)


def test_fv_train_names_an_unknown_method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fv_kernel.cli.app import app

    monkeypatch.setenv("FV_PLUGINS", "")  # the kernel's built-ins only: no training method
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: flow-matching\ncard: toy-dit\noutput_model_id: x\n")
    result = CliRunner().invoke(app, ["train", "--recipe", str(recipe), "--output", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 2
    assert "error: method: no registered training method 'flow-matching'" in result.output
