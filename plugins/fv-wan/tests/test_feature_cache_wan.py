"""wan-tiny's text encoder through the engine's feature cache (design §7.2), end to end.

The text-encode loop keys each text row (prompt, and negative prompt under CFG) by the
encoder's weights version, its precision and the cleaned text. An identical second request
runs no ``encode_text`` step; a request differing only in its negative prompt encodes only
that row; a different encoder precision or weights version misses, and its video equals
the one from an empty cache. The negative controls swap in a key that leaves out the
precision (or the weights version) and show the tests then fail: a stale embedding is
served and the video changes. (fv has no adapters yet, so the adapter-version part of
the key is checked at the ``CacheKey`` level only, in ``tests/test_feature_cache.py``.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch

import fv_wan.loops
from fv_kernel.api import (
    CacheKey,
    DiffusionParams,
    Engine,
    FeatureCache,
    InstanceOptions,
    ModelInstance,
    PrecisionPolicy,
    Request,
    SchedulerConfig,
    StepOp,
    TaskType,
    TextPart,
    build_instance,
    content_hash,
)
from fv_kernel.testing import assert_artifacts_identical
from fv_wan.cards import wan_cards


def _card(text_encoder_dtype: str | None = None) -> Any:
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    if text_encoder_dtype is None:
        return card
    spec = card.components["text_encoder"]
    spec = spec.model_copy(update={"precision_policy": PrecisionPolicy(dtype=text_encoder_dtype)})
    return card.model_copy(update={"components": {**card.components, "text_encoder": spec}})


def _counting(instance: ModelInstance) -> list[torch.Tensor]:
    """Record the token ids of every ``encode_text`` call the instance runs (one tensor per call)."""
    calls: list[torch.Tensor] = []
    build = instance.ops_builder

    def ops_builder(inst: ModelInstance) -> dict[str, StepOp]:
        ops = build(inst)
        if "encode_text" in ops:
            encode = ops["encode_text"].fn

            def counted(inputs: Any, params: Any) -> Any:
                calls.append(inputs["ids"].clone())
                return encode(inputs, params)

            ops["encode_text"] = dataclasses.replace(ops["encode_text"], fn=counted)
        return ops

    instance.ops_builder = ops_builder
    return calls


def _request(request_id: str, prompt: str = "a fox in the snow", negative: str = "blurry") -> Request:
    return Request(
        request_id=request_id, model="wan-tiny", task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text=prompt), TextPart(text=negative, role="negative_prompt")),
        diffusion=DiffusionParams(seed=7, steps=2, height=32, width=32, frames=5, guidance=5.0),
    )


def _engine(instance: ModelInstance, cache: FeatureCache | None = None) -> Engine:
    engine = Engine(SchedulerConfig())
    if cache is not None:
        engine.services["feature_cache"] = cache
    engine.add_instance(instance)
    return engine


def _rows(calls: list[torch.Tensor]) -> int:
    return sum(int(ids.shape[0]) for ids in calls)


def test_an_identical_second_request_runs_no_text_encoder_step() -> None:
    instance = build_instance(_card())
    calls = _counting(instance)
    engine = _engine(instance)
    cache: FeatureCache = engine.services["feature_cache"]
    first = engine.generate(_request("r1")).raise_for_status()
    assert _rows(calls) == 2 and (cache.stats.hits, cache.stats.misses, len(cache)) == (0, 2, 2)
    second = engine.generate(_request("r2")).raise_for_status()
    assert len(calls) == 1, "the second identical request ran the text encoder again"
    assert (cache.stats.hits, cache.stats.misses) == (2, 2)
    assert_artifacts_identical(first.artifacts, second.artifacts, what="cached embeddings vs encoded")


def test_a_request_differing_only_in_its_negative_prompt_encodes_only_that_row() -> None:
    instance = build_instance(_card())
    calls = _counting(instance)
    engine = _engine(instance)
    engine.generate(_request("r1")).raise_for_status()
    changed = _request("r2", negative="low quality, static")
    result = engine.generate(changed).raise_for_status()
    assert len(calls) == 2 and calls[1].shape[0] == 1, [c.shape for c in calls]
    tokenizer = instance.component("text_encoder").tokenizer
    negative_ids = tokenizer(
        [fv_wan.loops.clean_prompt("low quality, static")], padding="max_length", max_length=calls[1].shape[1],
        truncation=True, add_special_tokens=True, return_tensors="pt",
    ).input_ids
    assert torch.equal(calls[1], negative_ids), "the row encoded is not the new negative prompt"
    # The cached prompt row and the freshly encoded negative row give the video an empty cache gives.
    fresh = _engine(build_instance(_card())).generate(changed).raise_for_status()
    assert_artifacts_identical(fresh.artifacts, result.artifacts, what="half-cached vs fresh")


def _updated_weights(instance: ModelInstance) -> ModelInstance:
    """The instance after a text-encoder weights update (new weights, new version)."""
    with torch.no_grad():
        for p in instance.component("text_encoder").model.parameters():
            p.mul_(1.25)
    instance.weights_version = f"{instance.weights_version}+update1"
    return instance


#: How each key-field change is made: a second instance that differs only there.
VARIANTS: dict[str, Callable[[], ModelInstance]] = {
    "precision": lambda: build_instance(_card(text_encoder_dtype="bf16")),
    "weights_version": lambda: _updated_weights(build_instance(_card())),
}


def _run_changed_after_original(field: str) -> None:
    """Two instances sharing one feature cache, differing only in ``field``: the second must miss."""
    shared = FeatureCache()
    _engine(build_instance(_card()), shared).generate(_request("original")).raise_for_status()
    changed = VARIANTS[field]()
    calls = _counting(changed)
    result = _engine(changed, shared).generate(_request("changed")).raise_for_status()
    assert _rows(calls) == 2, f"a different text-encoder {field} was served the cached embeddings"
    fresh = _engine(VARIANTS[field]()).generate(_request("fresh")).raise_for_status()
    assert_artifacts_identical(fresh.artifacts, result.artifacts, what=f"{field} changed: shared cache vs empty cache")


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_a_different_encoder_precision_or_weights_version_misses(field: str) -> None:
    _run_changed_after_original(field)


class _KeyWithout(CacheKey):
    """A broken key builder: its digest leaves one field out."""

    dropped: str = ""

    def digest(self) -> str:
        fields = self.model_dump(mode="json", exclude={"dropped"})
        del fields[self.dropped]
        return content_hash(fields)


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_negative_control_a_key_without_the_field_serves_stale_embeddings(field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fv_wan.loops, "CacheKey", lambda **fields: _KeyWithout(**fields, dropped=field))
    with pytest.raises(AssertionError, match=f"text-encoder {field} was served the cached embeddings"):
        _run_changed_after_original(field)


def test_an_encoder_following_the_card_precision_is_keyed_by_the_instance_precision() -> None:
    """A text encoder with ``precision_policy.dtype == "card"`` runs in the instance's precision:
    an fp32 and a bf16 instance sharing one cache must not share its entries."""
    card = _card(text_encoder_dtype="card")
    shared = FeatureCache()
    _engine(build_instance(card, InstanceOptions(precision="fp32")), shared).generate(_request("fp32")).raise_for_status()
    bf16 = build_instance(card, InstanceOptions(precision="bf16"))
    calls = _counting(bf16)
    _engine(bf16, shared).generate(_request("bf16")).raise_for_status()
    assert _rows(calls) == 2, "a bf16 instance was served the fp32 instance's embeddings"
