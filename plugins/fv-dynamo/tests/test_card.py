"""The DeploymentCard: cards, programs, the cost model's prices per loop and shape, health and SLO."""

from __future__ import annotations

import json

import pytest

from fv_kernel.api import DeployConfig, build_engine
from fv_dynamo.card import DeploymentCard, SLOSchema, build_deployment_card, video_frame_ladder
from fv_dynamo.worker import FvWorker, WorkerConfigError, WorkerOptions


def test_card_describes_the_engine(engine) -> None:
    card = build_deployment_card(engine, engine_id="host/fv", fleet_endpoint="fv.fv.fleet",
                                 slo=SLOSchema(p95_latency_s={"video": 30.0}, max_queued_gpu_seconds=120))
    assert card.model_cards == ["wan-tiny"]
    assert set(card.supported_programs["wan-tiny"]) == {"text_to_video", "text_to_image"}
    assert card.capabilities["wan-tiny"]["frame_rule"] == {"modulus": 4, "remainder": 1}
    assert card.role_pools[0].roles == sorted(engine.instances["wan-tiny"].card.loops)
    assert card.health.fleet_endpoint == "fv.fv.fleet" and card.slo.p95_latency_s == {"video": 30.0}
    # The card is what rides in Dynamo's model card: JSON, and it reads back as itself.
    assert DeploymentCard.model_validate(json.loads(card.model_dump_json())) == card


def test_prices_per_loop_and_shape_come_from_the_engines_cost_model(engine) -> None:
    card = build_deployment_card(engine, fleet_endpoint="fv.fv.fleet")
    cost = card.cost_model[0]
    assert set(cost.loops) == set(engine.instances["wan-tiny"].card.loops)
    videos = [p for p in cost.prices if p.task == "text_to_video"]
    assert [p.frames for p in videos] == video_frame_ladder(engine.instances["wan-tiny"]) and len(videos) >= 2
    # More frames, more tokens per denoise step: a dearer request (a flat table would fail here).
    assert all(a.gpu_seconds < b.gpu_seconds for a, b in zip(videos, videos[1:]))
    images = [p for p in cost.prices if p.task == "text_to_image"]
    assert len(images) == 1 and images[0].frames == 1 and images[0].gpu_seconds < videos[0].gpu_seconds
    for point in cost.prices:
        # The whole price is what admission reserves; the per-loop shares add up to it.
        assert point.per_loop and abs(sum(point.per_loop.values()) - point.gpu_seconds) < 1e-9
        assert {"denoise", "decode"} <= set(point.per_loop)
        # Steps per loop (what a router models step interleaving with): the denoise loop runs the request's steps.
        assert point.steps_per_loop["denoise"] == point.steps and set(point.steps_per_loop) == set(point.per_loop)


def test_a_worker_serves_exactly_one_card() -> None:
    engine = build_engine(DeployConfig.model_validate({"cards": ["wan-tiny", "fastwan-tiny"]}))
    with pytest.raises(WorkerConfigError, match="exactly one card"):
        FvWorker(engine, WorkerOptions())


@pytest.mark.parametrize("model_id", ["wan-toy", "wan-toy-causal"])
def test_a_card_with_a_prompt_vocabulary_gets_its_prices(model_id: str) -> None:
    """The price requests' prompt is outside a toy card's vocabulary; the prices do not depend on it
    (``fv worker`` with wan-toy-causal exited at start before this)."""
    engine = build_engine(DeployConfig.model_validate({"cards": [model_id]}))
    card = build_deployment_card(engine, fleet_endpoint="fv.fv.fleet")
    assert card.model_cards == [model_id] and card.cost_model[0].prices
