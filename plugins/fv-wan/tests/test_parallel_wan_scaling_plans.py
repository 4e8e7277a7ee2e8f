"""Issue 20's 4- and 8-GPU plans against the real-size Wan 2.1 cards (cards and configs only, no weights).

``bench/bench_parallel.py`` measures these plans on 4 and 8 GPUs; here each one is checked
the way a deployment would be (``check_plan_against_card``, then the request's shape), and
the plans that do not fit are refused with a ``ParallelPlanError`` naming the axis.
"""

from __future__ import annotations

from typing import Any

import pytest
from bench_module import load_bench
from fv_wan.models.transformer import WanTransformerConfig
from fv_wan.parallel import WAN_PARALLEL, wan_tokens

from fv_kernel.api import (
    DiffusionParams,
    ParallelPlan,
    ParallelPlanError,
    Request,
    TaskType,
    TextPart,
)
from fv_kernel.parallel import check_plan_against_card


def refused(axis: str, build: Any) -> str:
    with pytest.raises(ParallelPlanError) as info:
        build()
    assert info.value.axis == axis, info.value
    assert info.value.param == f"parallel.{axis}"
    return str(info.value)


def request(card: Any, frames: int, height: int, width: int) -> Request:
    return Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                   diffusion=DiffusionParams(frames=frames, height=height, width=width))


def deploy_and_submit(card: Any, plan: ParallelPlan, frames: int, height: int, width: int) -> None:
    """What a deployment checks: the plan against the card (its default shape included), then the request."""
    check_plan_against_card(plan, card)
    WAN_PARALLEL.check_request(card, request(card, frames, height, width), plan)


def test_the_14b_720p_plans_fit_the_card(wan_card: Any) -> None:
    card = wan_card("wan2.1-t2v-14b")
    assert wan_tokens(card, 81, 720, 1280) == 75600  # 21 x 45 x 80
    assert WanTransformerConfig.from_diffusers_config(card.components["transformer"].config).num_attention_heads == 40
    for plan in (ParallelPlan(sp=8), ParallelPlan(sp=4, cfgp=2), ParallelPlan(sp=4), ParallelPlan(ulysses=4, ring=2)):
        deploy_and_submit(card, plan, 81, 720, 1280)
        plan.check_world(plan.world_size)
    assert ParallelPlan(sp=4, cfgp=2).world_size == ParallelPlan(sp=8).world_size == 8


def test_the_1_3b_480p_sp4_plan_fits_and_8_gpus_need_a_ring(wan_card: Any) -> None:
    card = wan_card("wan2.1-t2v-1.3b")
    assert wan_tokens(card, 81, 480, 832) == 32760
    deploy_and_submit(card, ParallelPlan(sp=4), 81, 480, 832)
    # 12 heads: Ulysses 8 does not divide them; on 8 GPUs the 1.3B runs USP 4 x 2 instead.
    text = refused("ulysses", lambda: check_plan_against_card(ParallelPlan(sp=8), card))
    assert "does not divide the 12 attention heads" in text and "allowed: 1, 2, 3, 4, 6, 12" in text
    deploy_and_submit(card, ParallelPlan(ulysses=4, ring=2), 81, 480, 832)


def test_a_ulysses_degree_the_14b_heads_do_not_divide_is_refused(wan_card: Any) -> None:
    card = wan_card("wan2.1-t2v-14b")
    text = refused("ulysses", lambda: check_plan_against_card(ParallelPlan(sp=6), card))  # 75,600 tokens divide by 6
    assert "does not divide the 40 attention heads" in text and "allowed: 1, 2, 4, 5, 8, 10, 20, 40" in text
    # Above the card's declared degree: refused before the heads are looked at.
    assert "max_degree['sp'] = 8" in refused("sp", lambda: check_plan_against_card(ParallelPlan(sp=10), card))


def test_a_ring_degree_that_does_not_divide_the_tokens_is_refused_at_submit(wan_card: Any) -> None:
    card = wan_card("wan2.1-t2v-14b")
    plan = ParallelPlan(ulysses=4, ring=2)
    check_plan_against_card(plan, card)
    assert wan_tokens(card, 81, 720, 1264) == 74655  # 21 x 45 x 79: odd
    text = refused("ring", lambda: WAN_PARALLEL.check_request(card, request(card, 81, 720, 1264), plan))
    assert "does not divide the 74655 tokens" in text


def test_vae8_does_not_fit_720p_but_fits_704p(wan_card: Any) -> None:
    """720p has 90 latent rows: neither 8 nor 4 divides them, so vae=8 (and vae=4) is refused there."""
    card = wan_card("wan2.1-t2v-14b")
    text = refused("vae", lambda: check_plan_against_card(ParallelPlan(sp=8, vae=8), card))  # the card's 720p default
    assert "does not divide the 90 latent rows of height 720" in text
    refused("vae", lambda: check_plan_against_card(ParallelPlan(sp=4, vae=4), card))
    check_plan_against_card(ParallelPlan(sp=2, vae=2), card)  # 45 rows each
    # The shape the bench decodes under vae=8: 704 rows -> 88 latent rows, 11 per GPU.
    WAN_PARALLEL.check_request(card, request(card, 81, 704, 1280), ParallelPlan(sp=8, vae=8))
    refused("world_size", lambda: ParallelPlan(sp=4, cfgp=2).check_world(4))


def test_every_plan_the_bench_measures_on_4_and_8_gpus_fits_its_real_card(wan_card: Any) -> None:
    """The bench's own table (real sizes) against the cards: the same configs, and each plan deployable.

    The sp=4 cases on 8 ranks run as two concurrent replicas (dp=2); each replica's plan is checked.
    """
    bench = load_bench()
    cards = {"14b": wan_card("wan2.1-t2v-14b"), "1.3b": wan_card("wan2.1-t2v-1.3b")}
    checked = set()
    for world in (4, 8):
        for name, (config, latent, cfg, degrees) in bench._cases(world, smoke=False).items():
            card = cards["14b" if "_14b_" in name else "1.3b"]
            assert config == WanTransformerConfig.from_diffusers_config(card.components["transformer"].config), name
            assert cfg and card.capabilities.uses_guidance, name  # issue 20's steps are with CFG
            replica = ParallelPlan(**{axis: degree for axis, degree in degrees.items() if axis != "dp"})
            assert replica.world_size * degrees.get("dp", 1) == world, name
            frames, rows, cols = latent
            deploy_and_submit(card, replica, (frames - 1) * 4 + 1, rows * 8, cols * 8)
            checked.add(name)
    assert checked == {"dit_14b_sp4", "dit_1.3b_sp4", "dit_14b_sp8", "dit_14b_sp4_cfgp2"}
    # The vae=8 decode's latent shape and the whole request's plans.
    frames, rows, cols = bench.VAE_LATENT[8]
    WAN_PARALLEL.check_request(cards["14b"], request(cards["14b"], (frames - 1) * 4 + 1, rows * 8, cols * 8),
                               ParallelPlan(sp=8, vae=8))
    for plan in (ParallelPlan(sp=8), ParallelPlan(sp=4, cfgp=2)):
        deploy_and_submit(cards["14b"], plan, 81, 720, 1280)
