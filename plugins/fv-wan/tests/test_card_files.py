"""fv-wan cards as card files: dump one, edit it, validate it, run it -- through the real CLI.

``fv cards validate`` builds each component's config through the card's ``config_schema``, the
same parser fv-wan's loaders use; the negative controls show a bad config passes pydantic's
shape check and is caught only by that build check (and, without it, fails at load).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from fv_kernel.api import InvalidCard, ModelCard, TaskType, build_instance, check_card_builds
from fv_kernel.cli.app import app
from fv_wan.cards import wan_cards
from doc_blocks import REPO, doc_blocks, run_doc_block

PROMPT = "a red fox"


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _dump(model_id: str) -> dict[str, Any]:
    """``fv cards show <model_id>``'s JSON (stdout; a sampler note goes to stderr)."""
    result = CliRunner().invoke(app, ["cards", "show", model_id])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{"): result.stdout.rindex("}") + 1])


def _write(tmp_path: Path, name: str, data: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_every_wan_component_declares_its_config_schema() -> None:
    for card in wan_cards():
        assert all(c.config_schema for c in card.components.values()), card.model_id
        assert check_card_builds(card) == [], card.model_id


def test_a_dumped_and_edited_wan_tiny_card_file_runs(tmp_path: Path) -> None:
    data = _dump("wan-tiny")
    data["model_id"] = "my-wan-tiny"
    data["capabilities"]["defaults"]["steps"] = 3
    path = _write(tmp_path, "my-wan-tiny.json", data)
    validated = _invoke("cards", "validate", str(path))
    assert validated.exit_code == 0 and "ok: my-wan-tiny (wan, recipe base; builds)" in validated.output, validated.output
    out = tmp_path / "from-file.pt"
    result = _invoke("generate", "--model", str(path), "--prompt", PROMPT, "--seed", "4", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert "3/3" in result.output and "8/8" not in result.output  # the file's default steps, not wan-tiny's 8
    # Exactly wan-tiny run with 3 steps: the card file changed the default and nothing else.
    same = tmp_path / "built-in.pt"
    result = _invoke("generate", "--quiet", "--model", "wan-tiny", "--steps", "3", "--prompt", PROMPT, "--seed", "4", "--output", str(same))
    assert result.exit_code == 0, result.output
    assert torch.equal(torch.load(out), torch.load(same))


BAD_FIELDS = [
    # (case, edit of the dumped card, the field named)
    ("num_layers not an int", lambda d: d["components"]["transformer"]["config"].update(num_layers="two"),
     "components.transformer.config.num_layers: Input should be a valid integer"),
    ("builder does not exist", lambda d: d["components"]["transformer"].update(builder="fv_wan.instance:load_nothing"),
     "components.transformer.builder: 'fv_wan.instance:load_nothing' does not import"),
    ("VAE latents_std length", lambda d: d["components"]["vae_decoder"]["config"].update(latents_std=[1.0]),
     "components.vae_decoder.config: Value error, latents_std needs z_dim = 16 values, got 1"),
    ("text encoder unknown field", lambda d: d["components"]["text_encoder"]["config"].update(width=3),
     "components.text_encoder.config.width: Extra inputs are not permitted"),
]


@pytest.mark.parametrize("case, edit, expected", BAD_FIELDS, ids=[c[0] for c in BAD_FIELDS])
def test_validate_and_generate_name_a_field_that_does_not_build(case: str, edit: Any, expected: str, tmp_path: Path) -> None:
    data = _dump("wan-tiny")
    edit(data)
    ModelCard.model_validate(data)  # negative control: the shape is valid, so pydantic alone passes this card
    path = _write(tmp_path, "bad.json", data)
    validated = _invoke("cards", "validate", str(path))
    assert validated.exit_code == 1 and expected in validated.output, validated.output
    out = tmp_path / "never.mp4"
    result = _invoke("generate", "--model", str(path), "--prompt", PROMPT, "--output", str(out))
    assert result.exit_code == 2 and not out.exists(), result.output
    (line,) = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert line.startswith(f"error: model: card file '{path}' is invalid: ") and expected in line and "Traceback" not in result.output


def test_loaders_parse_through_the_cards_config_schema(wan_card: Any) -> None:
    """The loader reads ``config_schema``: without the build check, the bad config fails at load, naming the same field."""
    card = wan_card("wan-tiny")
    data = card.model_dump()
    data["components"]["transformer"]["config"]["num_layers"] = "two"
    with pytest.raises(InvalidCard) as info:
        build_instance(ModelCard.model_validate(data)).load_for_task(TaskType.TEXT_TO_VIDEO)
    assert info.value.param == "components.transformer.config.num_layers"
    # Pointing the schema elsewhere changes what the loader parses with: a text-encoder schema refuses a DiT config.
    data = card.model_dump()
    data["components"]["transformer"]["config_schema"] = "fv_wan.component_configs:WanTextEncoderConfig"
    with pytest.raises(InvalidCard, match="components.transformer.config.num_layers: Extra inputs are not permitted"):
        build_instance(ModelCard.model_validate(data)).load_for_task(TaskType.TEXT_TO_VIDEO)
    # A schema that parses, but to the wrong type for this loader, is named too.
    data["components"]["transformer"]["config"] = {}
    with pytest.raises(InvalidCard, match="parses to WanTextEncoderConfig; this loader needs a WanTransformerConfig"):
        build_instance(ModelCard.model_validate(data)).load_for_task(TaskType.TEXT_TO_VIDEO)


def test_the_card_file_examples_in_docs_cards_md_run_as_written(tmp_path: Path) -> None:
    happy, failing = doc_blocks(REPO / "docs" / "cards.md", "plugins/fv-wan/tests/test_card_files.py")
    run_doc_block(happy, tmp_path)
    assert (tmp_path / "fox.mp4").stat().st_size > 0
    run_doc_block(failing, tmp_path)
    assert not (tmp_path / "never.mp4").exists()
