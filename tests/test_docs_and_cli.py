"""Docs stay true to the code: their example runs; `fv cards` validates cards by field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from fv_kernel.cli.app import app
from fv_kernel.testing.toy import toy_card

ROOT = Path(__file__).resolve().parents[1]


def test_minimal_card_example_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "minimal_card.py")],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert done.stdout.startswith("completed tensor(")


def test_cards_validate_accepts_a_good_card_file(tmp_path: Path) -> None:
    path = tmp_path / "card.json"
    path.write_text(toy_card("toy-dit").model_dump_json())
    result = CliRunner().invoke(app, ["cards", "validate", str(path)])
    assert result.exit_code == 0, result.output
    assert "ok: toy-dit" in result.output


def test_cards_validate_names_the_bad_field(tmp_path: Path) -> None:
    data = json.loads(toy_card("toy-dit").model_dump_json())
    data["recipe"]["assumes_precision"] = "int3"
    data["capabilities"]["spatial_multiple"] = 0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["cards", "validate", str(path)])
    assert result.exit_code == 1
    assert "recipe.assumes_precision" in result.output and "capabilities.spatial_multiple" in result.output


def test_cards_validate_unknown_card_is_one_line() -> None:
    result = CliRunner().invoke(app, ["cards", "validate", "no-such-card"])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: model: unknown card 'no-such-card'")


def test_cards_list_and_generate_help_work() -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["cards", "list"]).exit_code == 0
    help_text = runner.invoke(app, ["generate", "--help"]).output
    for flag in ("--model", "--prompt", "--negative-prompt", "--image", "--height", "--width", "--frames",
                 "--steps", "--guidance", "--shift", "--seed", "--output"):
        assert flag in help_text


def test_generate_rejects_bad_output_suffix_without_touching_a_model(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--model", "anything", "--prompt", "x", "--output", str(tmp_path / "x.gif")])
    assert result.exit_code == 2 and "output: unsupported suffix '.gif'" in result.output
    assert not (tmp_path / "x.gif").exists()
