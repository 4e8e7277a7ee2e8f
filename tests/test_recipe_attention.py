"""``RecipeSpec.assumes_attention``: a card whose weights were trained under an attention (e.g. VSA)
refuses another attention driver at deploy with ``RecipeMismatch``, unless the deployment
overrides its recipe; the override is recorded on the instance and the artifacts' provenance."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pydantic import ValidationError

from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import build_instance
from fv_kernel.card.spec import AttentionAssumption, ModelCard
from fv_kernel.card.recipe import check_recipe_attention
from fv_kernel.errors import RecipeMismatch
from fv_kernel.request.artifacts import Provenance
from fv_kernel.testing.toy import toy_card

VSA = {"kind": "vsa", "sparsity": 0.8, "tile": (4, 4, 4)}


def card_with(**changes: Any) -> ModelCard:
    data = toy_card("toy-dit").model_dump()
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return ModelCard.model_validate(data)


def vsa_card() -> ModelCard:
    return card_with(model_id="toy-vsa", recipe={"method": "dmd2_vsa", "assumes_attention": VSA})


def test_assumes_attention_is_typed() -> None:
    assert vsa_card().recipe.assumes_attention == AttentionAssumption(kind="vsa", sparsity=0.8, tile=(4, 4, 4))
    for bad, field in (({**VSA, "sparsity": 1.0}, "sparsity"), ({**VSA, "tile": (4, 0, 4)}, "tile"),
                       ({**VSA, "kind": "Not A Name!"}, "kind"), ({**VSA, "blocks": 3}, "blocks")):
        with pytest.raises(ValidationError) as info:
            card_with(recipe={"assumes_attention": bad})
        assert field in str(info.value)


def test_another_attention_backend_is_a_recipe_mismatch_naming_the_field() -> None:
    with pytest.raises(RecipeMismatch) as info:
        build_instance(vsa_card(), InstanceOptions(attention_backend="sdpa"))
    assert info.value.param == "attention_backend"
    message = str(info.value)
    assert "'dmd2_vsa'" in message and "attention 'vsa' (sparsity 0.8, tile 4x4x4)" in message
    assert "'sdpa'" in message and "override_recipe" in message
    # The default options (sdpa) are "another attention" too: a VSA card never silently runs dense.
    with pytest.raises(RecipeMismatch):
        build_instance(vsa_card())


def test_the_recipes_own_attention_deploys_without_override() -> None:
    instance = build_instance(vsa_card(), InstanceOptions(attention_backend="vsa"))
    assert instance.recipe_overrides == ()


def test_negative_control_a_card_without_assumes_attention_takes_any_backend() -> None:
    plain = card_with(model_id="toy-plain")
    assert check_recipe_attention(plain, "sdpa", allow_recipe_mismatch=False) is False
    assert build_instance(plain, InstanceOptions(attention_backend="sdpa")).recipe_overrides == ()


def test_the_override_deploys_logs_and_is_recorded(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fv.card"):
        instance = build_instance(vsa_card(), InstanceOptions(attention_backend="sdpa", allow_recipe_mismatch=True))
    assert instance.recipe_overrides == ("attention_backend",)
    assert any("toy-vsa" in r.getMessage() and "overridden" in r.getMessage() for r in caplog.records)
    # Provenance carries the overrides (fv-wan's decode loop stamps them; its tests check that path).
    assert Provenance(model_id="m", loop_id="l", request_id="r", recipe_overrides=instance.recipe_overrides).recipe_overrides == (
        "attention_backend",
    )
    assert Provenance(model_id="m", loop_id="l", request_id="r").recipe_overrides == ()


def test_precision_and_attention_overrides_are_both_recorded() -> None:
    card = card_with(
        model_id="toy-both", recipe={"method": "qat_vsa", "assumes_precision": "bf16", "assumes_attention": VSA},
        precision={"default": "bf16", "supported": frozenset({"fp32", "bf16"})},
    )
    instance = build_instance(card, InstanceOptions(precision="fp32", allow_recipe_mismatch=True))
    assert instance.recipe_overrides == ("precision", "attention_backend")
