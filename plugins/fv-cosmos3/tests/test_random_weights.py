"""Random-weight cards say so (issue 35): ``fv cards list`` marks them, and their text is never
presented as if it meant something (``cosmos3-tiny --upsample-prompt`` printed binary garbage)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fv_kernel.api import CardCatalog, PluginHost, Provenance, TaskType, TextArtifact, VideoArtifact
from fv_kernel.cli.app import app
from fv_kernel.cli.generate_cmd import write_result

import torch


def _cards() -> dict[str, object]:
    return {model_id: entry.card for model_id, entry in CardCatalog(PluginHost()).entries().items()}


def test_random_weights_follow_the_checkpoint_manifest() -> None:
    cards = _cards()
    assert cards["cosmos3-tiny"].random_weights and "transformer" in cards["cosmos3-tiny"].random_weight_components
    assert cards["wan-tiny"].random_weights and cards["wan-toy-init"].random_weights
    assert not cards["cosmos3-nano"].random_weights and not cards["wan-toy"].random_weights


def test_cards_list_marks_random_weight_cards() -> None:
    listed = CliRunner().invoke(app, ["cards", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {row["model_id"]: row for row in json.loads(listed.stdout)}
    assert rows["cosmos3-tiny"]["random_weights"] is True and rows["cosmos3-nano"]["random_weights"] is False
    table = CliRunner().invoke(app, ["cards", "list"], env={"COLUMNS": "100"}).stdout.splitlines()
    (tiny,) = [line for line in table if line.startswith("cosmos3-tiny ")]
    (nano,) = [line for line in table if line.startswith("cosmos3-nano ")]
    assert tiny.startswith("cosmos3-tiny (random)") and "(random)" not in nano
    assert any(line.startswith("(random): seeded random weights, never trained") for line in table)


def _text(name: str, text: str) -> TextArtifact:
    prov = Provenance(model_id="cosmos3-tiny", loop_id="upsample", request_id="r")
    return TextArtifact(name=name, text=text, token_ids=[1, 2], provenance=prov)


def test_a_random_cards_rewritten_prompt_is_not_shown(tmp_path: Path) -> None:
    video = VideoArtifact(frames=torch.zeros(1, 3, 8, 8), fps=8.0,
                          provenance=Provenance(model_id="cosmos3-tiny", loop_id="decode", request_id="r"))
    garbage = "\u0f3a\x00\x1bq\ufffd"
    hidden = write_result([_text("upsampled_prompt", garbage), video], tmp_path / "o.png", "cosmos3-tiny",
                          TaskType.TEXT_TO_VIDEO, random_weights=True)
    assert hidden[0] == "upsampled_prompt: not shown: card 'cosmos3-tiny' has random weights, its text is meaningless (5 characters)"
    # negative control: a trained card's rewrite is shown (escaped)
    shown = write_result([_text("upsampled_prompt", "a fox"), video], tmp_path / "p.png", "cosmos3-nano", TaskType.TEXT_TO_VIDEO)
    assert shown[0] == "upsampled_prompt: a fox"


def test_cli_upsampling_on_cosmos3_tiny_prints_no_garbage(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--model", "cosmos3-tiny", "--prompt", "a robot arm", "--seed", "3", "-q",
                                      "--upsample-prompt", "--max-tokens", "8", "--output", str(tmp_path / "up.png")])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("upsampled_prompt: ")]
    assert line.startswith("upsampled_prompt: not shown: card 'cosmos3-tiny' has random weights")


def test_a_random_cards_text_answer_is_labelled(tmp_path: Path) -> None:
    out = tmp_path / "a.txt"
    result = CliRunner().invoke(app, ["generate", "--model", "cosmos3-tiny", "--prompt", "a robot arm", "-q",
                                      "--task", "text_generation", "--max-tokens", "4", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "has random weights (seeded, never trained" in result.stderr and "its text means nothing" in result.stderr
    assert "this text is meaningless" in result.stdout and out.is_file()
