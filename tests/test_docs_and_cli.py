"""Docs stay true to the code: their example runs; `fv cards` validates cards by field."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
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
    result = CliRunner().invoke(app, ["generate", "--model", "anything", "--prompt", "x", "--output", str(tmp_path / "x.webm")])
    assert result.exit_code == 2 and "output: unsupported suffix '.webm'" in result.output
    assert not (tmp_path / "x.webm").exists()


def test_readme_layout_table_lists_every_plugin() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `plugins/([^/`]+)/` \| \S", layout, flags=re.M))
    on_disk = {p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file()}
    assert on_disk and listed == on_disk


def test_architecture_fleet_line_names_what_fv_dynamo_has() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    fleet = next(p for p in doc.split("\n- ") if p.startswith("**Fleet.**"))
    assert "No `DeploymentCard`" not in fleet
    # What the line names exists in fv-dynamo (read from its source: the kernel env need not install it).
    dynamo = ROOT / "plugins" / "fv-dynamo" / "fv_dynamo"
    for module, cls in (("card", "DeploymentCard"), ("router", "CostAwareRouter")):
        assert cls in fleet
        tree = ast.parse((dynamo / f"{module}.py").read_text(encoding="utf-8"))
        assert cls in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}, f"fv_dynamo.{module}.{cls}"
    assert "fv worker" in fleet and re.search(r"^\s+worker: \{target:", (dynamo / "fv-plugin.yaml").read_text(encoding="utf-8"), re.M)


def test_serving_install_is_from_the_repository() -> None:
    """fv is on no package index: the serving doc installs the checkout, with extras the kernel declares."""
    doc = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    first_block = doc.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "fv-kernel[" not in first_block and "pip install -e plugins" not in first_block
    installs = re.findall(r'pip install "\.\[([a-z,]+)\]"((?: \./plugins/[\w-]+)+)', first_block)
    assert installs, first_block
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for names, plugins in installs:
        assert "serve" in names.split(",") and set(names.split(",")) <= set(extras)
        for plugin in plugins.split():
            assert (ROOT / plugin / "pyproject.toml").is_file(), plugin
