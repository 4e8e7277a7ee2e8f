"""Cards that build, card files, and what ``--model`` says when it names nothing runnable.

* ``fv_kernel.model.buildcheck``: a card's code references import and its component configs
  parse through ``ComponentSpec.config_schema`` -- with negative controls: each bad card below
  passes pydantic validation (the shape is fine) and only the build check catches it.
* Card files: ``fv generate --model card.json`` (or ``.yaml``) runs a card that passes
  ``fv cards validate``; one that does not is one line naming the field.
* ``CardCatalog.resolve``: a plugin may answer a source with a card it derived; path errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from fv_kernel.api import (
    DiffusionParams,
    FvError,
    InvalidCard,
    InvalidRequest,
    ModelCard,
    Request,
    TaskType,
    TextPart,
    build_instance,
    check_card_builds,
    hookimpl,
    parse_component_config,
)
from fv_kernel.model.catalog import CardCatalog
from fv_kernel.card.spec import ComponentSpec, GenerationDefaults
from fv_kernel.cli.app import app
from fv_kernel.plugins import PluginError, PluginHost
from fv_kernel.runtime.local import run_local
from fv_kernel.testing.toy import toy_card

#: A pydantic model the kernel already has, standing in for a family's component config schema.
SCHEMA = "fv_kernel.card.spec:GenerationDefaults"
GOOD_CONFIG = {"height": 8, "width": 8, "frames": 3, "fps": 8.0, "steps": 4, "guidance": 3.0}


def _toy_data(**component_updates: Any) -> dict[str, Any]:
    data = json.loads(toy_card("toy-dit").model_dump_json())
    data["components"]["dit"].update(component_updates)
    return data


def _fields(problems: Any) -> list[str]:
    return [p.field for p in problems]


# --------------------------------------------------------------------------- the build check


def test_a_good_card_builds_and_its_schema_parses_the_config() -> None:
    assert check_card_builds(toy_card("toy-dit")) == []
    card = ModelCard.model_validate(_toy_data(config_schema=SCHEMA, config=GOOD_CONFIG))
    assert check_card_builds(card) == []
    parsed = parse_component_config(card.components["dit"])
    assert isinstance(parsed, GenerationDefaults) and parsed.steps == 4


BAD_CARDS = [
    # (case, component updates, card-level updates, the field the check names, message fragment)
    ("builder does not exist", {"builder": "fv_kernel.testing.toy:no_such_builder"}, {}, "components.dit.builder", "does not import"),
    ("builder module does not exist", {"builder": "fv_nowhere.models:build"}, {}, "components.dit.builder", "No module named"),
    ("builder is not callable", {"builder": "fv_kernel.testing.toy:__all__"}, {}, "components.dit.builder", "not callable"),
    ("config field of the wrong type", {"config_schema": SCHEMA, "config": {**GOOD_CONFIG, "steps": "two"}}, {},
     "components.dit.config.steps", "valid integer"),
    ("config field missing", {"config_schema": SCHEMA, "config": {"height": 8}}, {}, "components.dit.config.width", "Field required"),
    ("config_schema does not import", {"config_schema": "fv_kernel.card.spec:NoSuchSchema"}, {},
     "components.dit.config_schema", "does not import"),
    ("factory does not exist", {}, {"factory": "fv_kernel.testing.toy:no_factory"}, "factory", "does not import"),
]


@pytest.mark.parametrize("case, component, card_level, field, fragment", BAD_CARDS, ids=[c[0] for c in BAD_CARDS])
def test_the_build_check_names_what_would_not_build(case: str, component: dict, card_level: dict, field: str, fragment: str) -> None:
    data = _toy_data(**component)
    data.update(card_level)
    card = ModelCard.model_validate(data)  # negative control: the card's shape is valid, pydantic passes it
    problems = check_card_builds(card)
    assert field in _fields(problems), (case, problems)
    assert fragment in next(str(p) for p in problems if p.field == field)


def test_a_loop_implementation_must_be_a_class() -> None:
    data = json.loads(toy_card("toy-dit").model_dump_json())
    data["loops"]["denoise"]["implementation"] = "fv_kernel.testing.toy:toy_card"  # a function
    problems = check_card_builds(ModelCard.model_validate(data))
    assert _fields(problems) == ["loops.denoise.implementation"] and "not a class" in str(problems[0])


def test_loaders_parse_through_the_same_schema() -> None:
    """``parse_component_config`` is what a loader calls: the declared schema, else its default, else the dict."""
    spec = ComponentSpec(component_id="dit", kind="dit", builder="fv_kernel.testing.toy:build_component",
                         config={**GOOD_CONFIG, "steps": "two"}, config_schema=SCHEMA)
    with pytest.raises(InvalidCard) as info:
        parse_component_config(spec)
    assert info.value.param == "components.dit.config.steps" and "(got 'two')" in info.value.message
    plain = spec.model_copy(update={"config_schema": None, "config": GOOD_CONFIG})
    assert parse_component_config(plain) == GOOD_CONFIG
    assert parse_component_config(plain, default=GenerationDefaults.model_validate).steps == 4
    with pytest.raises(InvalidCard, match="components.dit.config: boom"):
        parse_component_config(plain, default=lambda config: (_ for _ in ()).throw(ValueError("boom")))


def test_config_schema_must_be_an_import_string() -> None:
    with pytest.raises(ValueError, match="is not a 'package.module:attribute' reference"):
        ComponentSpec(component_id="dit", kind="dit", builder="a.b:c", config_schema="not an import string")


# --------------------------------------------------------------------------- fv cards validate


def _validate(path: Path) -> Any:
    return CliRunner().invoke(app, ["cards", "validate", str(path)])


def test_cards_validate_runs_the_build_check(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_toy_data(builder="fv_kernel.testing.toy:no_such_builder", config_schema=SCHEMA,
                                        config={**GOOD_CONFIG, "steps": "two"})))
    result = _validate(bad)
    assert result.exit_code == 1, result.output
    assert "components.dit.builder: 'fv_kernel.testing.toy:no_such_builder' does not import" in result.output
    assert "components.dit.config.steps: Input should be a valid integer" in result.output
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_toy_data(config_schema=SCHEMA, config=GOOD_CONFIG)))
    result = _validate(good)
    assert result.exit_code == 0, result.output
    # It says which component configs it could not check (no config_schema declared).
    assert "ok: toy-dit (toy, recipe base; builds; not checked (no config_schema): decoder, lm)" in result.output


def test_cards_validate_missing_file_is_one_line(tmp_path: Path) -> None:
    result = _validate(tmp_path / "nowhere.json")
    assert result.exit_code == 2 and result.output.strip() == f"error: model: no such card file: '{tmp_path / 'nowhere.json'}'"


# --------------------------------------------------------------------------- card files


def _card_file(tmp_path: Path, name: str, *, steps: int, suffix: str = ".json") -> Path:
    data = json.loads(toy_card("toy-dit").model_dump_json())
    data["model_id"] = name
    data["capabilities"]["defaults"]["steps"] = steps
    path = tmp_path / f"{name}{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else yaml.safe_dump(data))
    return path


def _generate(model: str, out: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, ["generate", "--model", model, "--prompt", "a toy", "--seed", "2", "--output", str(out), *extra])


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_generate_runs_a_card_file_with_its_edited_defaults(suffix: str, tmp_path: Path) -> None:
    path = _card_file(tmp_path, "my-toy", steps=3, suffix=suffix)
    assert _validate(path).exit_code == 0
    out = tmp_path / "out.pt"
    result = _generate(str(path), out)
    assert result.exit_code == 0, result.output
    assert "3/3" in result.output and "4/4" not in result.output  # the file's default steps, not toy-dit's 4
    edited = toy_card("toy-dit").model_copy(update={"model_id": "my-toy"})
    request = Request(model="my-toy", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a toy"),),
                      diffusion=DiffusionParams(seed=2, steps=3))
    (expected,) = run_local(request, build_instance(edited))
    assert torch.equal(torch.load(out), expected.frames)


def test_generate_refuses_a_card_file_that_does_not_validate(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_toy_data(config_schema=SCHEMA, config={**GOOD_CONFIG, "steps": "two"})))
    out = tmp_path / "never.pt"
    result = _generate(str(bad), out)
    assert result.exit_code == 2 and not out.exists(), result.output
    (line,) = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert line.startswith(f"error: model: card file '{bad}' is invalid: components.dit.config.steps: Input should be a valid integer")
    shape = tmp_path / "shape.json"
    data = json.loads(toy_card("toy-dit").model_dump_json())
    data["capabilities"]["spatial_multiple"] = 0
    shape.write_text(json.dumps(data))
    result = _generate(str(shape), out)
    assert result.exit_code == 2 and "capabilities.spatial_multiple: Input should be greater than or equal to 1" in result.output
    broken = tmp_path / "broken.yaml"
    broken.write_text("model_id: [unclosed")
    result = _generate(str(broken), out)
    assert result.exit_code == 2 and f"error: model: cannot read card file '{broken}'" in result.output


# --------------------------------------------------------------------------- resolve: derived cards and path errors


class _DerivingPlugin:
    """Answers ``toy://<name>`` with a toy card it 'derived' (model_id ``<name>``)."""

    def __init__(self, card_for: Any) -> None:
        self.card_for = card_for

    @hookimpl
    def fv_register_model_cards(self, register: Any) -> None:
        register("toy-dit", toy_card("toy-dit"))

    @hookimpl
    def fv_resolve_model_source(self, source: str) -> Any:
        return self.card_for(source) if source.startswith("toy://") else None


def _catalog(card_for: Any) -> CardCatalog:
    host = PluginHost(discover=False)
    host.start()
    host.register(_DerivingPlugin(card_for), name="fv-deriving")
    return CardCatalog(host)


def _renamed(name: str, **updates: Any) -> ModelCard:
    return toy_card("toy-dit").model_copy(update={"model_id": name, **updates})


def test_a_plugin_may_answer_a_source_with_a_derived_card() -> None:
    resolved = _catalog(lambda source: _renamed(source.removeprefix("toy://"))).resolve("toy://toy-local-1")
    assert resolved.card.model_id == "toy-local-1" and resolved.source == "toy://toy-local-1"


def test_a_derived_card_is_checked_before_use() -> None:
    with pytest.raises(InvalidRequest, match="which an installed card already is"):
        _catalog(lambda source: _renamed("toy-dit")).resolve("toy://x")
    broken = _renamed("toy-broken", factory="fv_kernel.testing.toy:no_factory")
    with pytest.raises(InvalidRequest, match="does not build: factory: 'fv_kernel.testing.toy:no_factory' does not import"):
        _catalog(lambda source: broken).resolve("toy://x")


def test_a_plugin_answer_of_the_wrong_type_or_a_crash_is_a_plugin_error() -> None:
    with pytest.raises(PluginError, match="returned int, expected a card id string, a ModelCard or None"):
        _catalog(lambda source: 3).resolve("toy://x")
    with pytest.raises(PluginError, match="fv_resolve_model_source failed for 'toy://x': ZeroDivisionError"):
        _catalog(lambda source: 1 / 0).resolve("toy://x")

    def typed(source: str) -> Any:
        raise InvalidRequest("model", "toy://x: unsupported toy field")

    with pytest.raises(InvalidRequest, match="unsupported toy field"):  # a typed error passes through as is
        _catalog(typed).resolve("toy://x")


def test_path_errors_say_what_is_wrong(tmp_path: Path) -> None:
    catalog = _catalog(lambda source: None)
    (tmp_path / "empty").mkdir()
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "SomePipeline"}))
    (tmp_path / "bad-index").mkdir()
    (tmp_path / "bad-index" / "model_index.json").write_text("{not json")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    cases = [
        (str(tmp_path / "a" / "b"), f"model: no such file or directory: '{tmp_path}/a/b'"),
        ("./not/there/at/all", "model: no such file or directory: './not/there/at/all'"),
        (str(tmp_path / "empty"), "is a directory but not a checkpoint: it has no model_index.json"),
        (str(tmp_path / "pipe"), "is a diffusers-layout checkpoint of pipeline 'SomePipeline', which no installed plugin serves"),
        (str(tmp_path / "bad-index"), "model_index.json is not valid JSON"),
        (str(tmp_path / "weights.bin"), "is a file but not a card file; allowed: a card id, a card file (.json, .yaml, .yml)"),
        ("no-such-card", "model: unknown card 'no-such-card'; allowed: toy-dit"),
        ("org/unknown-repo", "model: unknown card 'org/unknown-repo'"),
    ]
    for model, fragment in cases:
        with pytest.raises(FvError) as info:
            catalog.resolve(model)
        assert fragment in info.value.message, (model, info.value.message)
        assert info.value.param == "model"
