"""The recipe has teeth at deploy time too: ``assumes_precision`` against the instance,
``Request.precision`` against the instance, ``consistency_required`` against the parity level."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from fv_kernel.model.catalog import ResolvedModel
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import build_instance
from fv_kernel.card.spec import ModelCard, ParityLevel
from fv_kernel.model.validate import resolve_request
from fv_kernel.config import DeployConfig
from fv_kernel.errors import InvalidRequest, RecipeMismatch
from fv_kernel.request.request import Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.runtime.local import run_local
from fv_kernel.testing.toy import toy_card


def card_with(**changes: Any) -> ModelCard:
    """toy-dit re-cut with other recipe / precision / parity fields (validated like any card)."""
    data = toy_card("toy-dit").model_dump()
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return ModelCard.model_validate(data)


def qat_card() -> ModelCard:
    """A card whose recipe baked bf16 in (a QAT-style recipe); it also lists fp32 as runnable."""
    return card_with(
        model_id="toy-qat",
        recipe={"method": "qat_bf16", "assumes_precision": "bf16"},
        precision={"default": "bf16", "supported": frozenset({"fp32", "bf16"})},
    )


def two_precision_card() -> ModelCard:
    """A base recipe that runs in fp32 or bf16."""
    return card_with(model_id="toy-2p", precision={"default": "fp32", "supported": frozenset({"fp32", "bf16"})})


def t2v(model: str, **changes: Any) -> Request:
    return Request(model=model, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),), **changes)


def served(card: ModelCard, **options: Any) -> Engine:
    engine = Engine(SchedulerConfig(device_thread=False))
    engine.add_instance(build_instance(card, InstanceOptions(**options)))
    return engine


# -- assumes_precision at deploy ------------------------------------------------------------


def test_an_instance_outside_assumes_precision_is_a_recipe_mismatch() -> None:
    with pytest.raises(RecipeMismatch) as info:
        build_instance(qat_card(), InstanceOptions(precision="fp32"))
    assert info.value.param == "precision"
    message = str(info.value)
    assert "'qat_bf16'" in message and "precision 'bf16'" in message and "'fp32'" in message
    assert "override_recipe" in message
    # The recipe's own precision, explicit or the card's default, deploys.
    assert build_instance(qat_card(), InstanceOptions(precision="bf16")).precision == "bf16"
    assert build_instance(qat_card()).recipe_overrides == ()


def test_the_override_deploys_and_is_logged_and_recorded(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fv.card"):
        instance = build_instance(qat_card(), InstanceOptions(precision="fp32", allow_recipe_mismatch=True))
    assert instance.precision == "fp32"
    assert instance.recipe_overrides == ("precision",)
    assert any("toy-qat" in r.getMessage() and "overridden" in r.getMessage() for r in caplog.records)


def test_a_card_whose_default_contradicts_its_recipe_is_invalid() -> None:
    with pytest.raises(ValidationError) as info:
        card_with(recipe={"assumes_precision": "bf16"}, precision={"default": "fp32", "supported": frozenset({"fp32", "bf16"})})
    assert "precision.default" in str(info.value) and "recipe.assumes_precision" in str(info.value)


def test_deploy_config_override_recipe_reaches_the_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    from fv_kernel.deploy import engine as deploy

    class OneCardCatalog:
        def __init__(self, host: Any) -> None:
            pass

        def resolve(self, model: str) -> ResolvedModel:
            return ResolvedModel(qat_card(), None)

    monkeypatch.setattr(deploy, "CardCatalog", OneCardCatalog)
    base = {"plugins": {"autoload": False}, "cards": [{"model": "toy-qat", "precision": "fp32"}]}
    with pytest.raises(RecipeMismatch):
        deploy.build_engine(DeployConfig.model_validate(base))
    base["cards"][0]["override_recipe"] = True
    engine = deploy.build_engine(DeployConfig.model_validate(base))
    assert engine.instances["toy-qat"].recipe_overrides == ("precision",)


# -- Request.precision against the instance ----------------------------------------------------


def test_request_precision_is_honoured_when_it_is_the_instance_precision() -> None:
    engine = served(two_precision_card(), precision="bf16")
    result = engine.generate(t2v("toy-2p", precision="bf16"))
    assert result.status == "completed"


def test_request_precision_other_than_the_instance_precision_is_refused() -> None:
    card = two_precision_card()
    request = t2v("toy-2p", precision="bf16")
    # Negative control: the card alone accepts bf16, so only the instance check can catch that
    # this deployment would silently run the request in fp32.
    assert resolve_request(card, request).precision == "bf16"
    engine = served(card)  # the card's default: fp32
    with pytest.raises(InvalidRequest) as info:
        engine.validate(request)
    assert info.value.param == "precision" and info.value.allowed == ["fp32"]
    assert "allowed: fp32" in str(info.value)
    assert engine.validate(t2v("toy-2p", precision="fp32")).precision == "fp32"
    assert engine.validate(t2v("toy-2p")).precision is None  # unset: the instance's precision
    # The scheduler-free path refuses it the same way.
    with pytest.raises(InvalidRequest) as info:
        run_local(request, build_instance(card))
    assert info.value.param == "precision"


def test_request_precision_on_an_overridden_instance() -> None:
    engine = served(qat_card(), precision="fp32", allow_recipe_mismatch=True)
    # The deployment overrode the recipe: fp32 is this instance's precision and is served.
    assert engine.generate(t2v("toy-qat", precision="fp32")).status == "completed"
    # bf16 is the recipe's precision but not this instance's.
    with pytest.raises(InvalidRequest) as info:
        engine.validate(t2v("toy-qat", precision="bf16"))
    assert not isinstance(info.value, RecipeMismatch) and info.value.allowed == ["fp32"]
    # Without the override, asking for fp32 stays a recipe mismatch.
    with pytest.raises(RecipeMismatch):
        served(qat_card()).validate(t2v("toy-qat", precision="fp32"))


# -- fv generate --precision / --override-recipe ---------------------------------------------------


@pytest.fixture
def cli_card(monkeypatch: pytest.MonkeyPatch) -> dict[str, ModelCard]:
    """``fv generate --model <id>`` resolves to the test's cards instead of the installed plugins'."""
    from fv_kernel.deploy import model_resolution  # where fv generate (and fv.load) resolve --model

    cards = {"toy-qat": qat_card(), "toy-2p": two_precision_card()}

    class TestCatalog:
        def __init__(self, host: Any) -> None:
            pass

        def resolve(self, model: str) -> ResolvedModel:
            return ResolvedModel(cards[model], None)

    monkeypatch.setattr(model_resolution, "CardCatalog", TestCatalog)
    return cards


def run_cli(*args: str) -> Any:
    from fv_kernel.cli.app import app

    return CliRunner().invoke(app, ["generate", "--prompt", "a fox", "--quiet", *args])


def test_fv_generate_precision_is_honoured(cli_card: dict[str, ModelCard], tmp_path: Path) -> None:
    out = tmp_path / "x.pt"
    result = run_cli("--model", "toy-2p", "--precision", "bf16", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert torch.load(out).shape[1] == 3


def test_fv_generate_refuses_a_precision_the_recipe_excludes_unless_overridden(
    cli_card: dict[str, ModelCard], tmp_path: Path
) -> None:
    out = tmp_path / "x.pt"
    refused = run_cli("--model", "toy-qat", "--precision", "fp32", "--output", str(out))
    assert refused.exit_code == 2
    assert "precision:" in refused.output and "assumes precision 'bf16'" in refused.output
    assert not out.exists()
    overridden = run_cli("--model", "toy-qat", "--precision", "fp32", "--override-recipe", "--output", str(out))
    assert overridden.exit_code == 0, overridden.output
    assert "warning:" in overridden.output and "outside its recipe" in overridden.output
    assert out.exists()


# -- consistency_required ------------------------------------------------------------------------


def test_parity_level_below_consistency_required_is_invalid() -> None:
    with pytest.raises(ValidationError) as info:
        card_with(recipe={"method": "diffusion_nft", "consistency_required": "C2"})  # toy parity level is C1
    message = str(info.value)
    assert "parity.level C1" in message and "recipe.consistency_required C2" in message
    # At or above the required rung is valid.
    assert card_with(recipe={"consistency_required": "C1"}).parity.level is ParityLevel.C1
    assert card_with(recipe={"consistency_required": "C2"}, parity={"level": "C3"}).parity.level is ParityLevel.C3


def test_the_ladder_is_ordered() -> None:
    assert [level.rank for level in ParityLevel] == [0, 1, 2, 3, 4]
