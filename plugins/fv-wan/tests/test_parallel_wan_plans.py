"""Wan's plan checks (no processes): heads vs Ulysses, tokens vs sp, CFG ownership, cards' contract."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from fv_kernel.api import DiffusionParams, ParallelPlan, ParallelPlanError, Request, TaskType, TextPart
from fv_kernel.config import CardDeployment, DeployConfig
from fv_kernel.parallel import check_plan_against_card
from fv_wan.parallel import WAN_PARALLEL, wan_tokens


def refused(axis: str, build: Any) -> str:
    with pytest.raises(ParallelPlanError) as info:
        build()
    assert info.value.axis == axis, info.value
    return str(info.value)


def test_wan_cards_declare_sp_and_cfgp_with_their_implementation(wan_card: Any) -> None:
    card = wan_card("wan2.1-t2v-1.3b")
    assert card.parallelism.max_degree == {"sp": 8, "cfgp": 2, "vae": 8}
    assert wan_card("wan2.2-ti2v-5b").parallelism.max_degree["vae"] == 1  # the 2.2 VAE is not split
    assert card.parallelism.implementation == "fv_wan.parallel:WAN_PARALLEL"
    assert wan_card("fastwan-tiny").parallelism.max_degree["cfgp"] == 1  # no guidance, no cfgp
    check_plan_against_card(ParallelPlan(sp=2, cfgp=2), card)
    check_plan_against_card(ParallelPlan(ulysses=2, ring=2), wan_card("wan-tiny"))


def test_a_ulysses_degree_must_divide_the_heads(wan_card: Any) -> None:
    text = refused("ulysses", lambda: check_plan_against_card(ParallelPlan(sp=4), wan_card("wan-tiny")))
    assert "does not divide the 2 attention heads" in text and "allowed: 1, 2" in text
    # wan2.1-1.3b has 12 heads: 4 divides them, 8 does not.
    check_plan_against_card(ParallelPlan(sp=4), wan_card("wan2.1-t2v-1.3b"))
    refused("ulysses", lambda: check_plan_against_card(ParallelPlan(sp=8), wan_card("wan2.1-t2v-1.3b")))


def test_cfgp_on_a_card_without_guidance_is_refused(wan_card: Any) -> None:
    text = refused("cfgp", lambda: check_plan_against_card(ParallelPlan(cfgp=2), wan_card("fastwan-tiny")))
    assert "max_degree['cfgp'] = 1" in text  # the card declares no cfgp (the kernel's own guidance check is behind it)


def test_cfg_owned_by_batched_dispatch_and_cfgp_is_a_build_error(wan_card: Any) -> None:
    text = refused("cfgp", lambda: check_plan_against_card(ParallelPlan(cfgp=2), wan_card("wan-tiny", cfg_dispatch="batched")))
    assert "batched dispatch" in text
    check_plan_against_card(ParallelPlan(cfgp=2), wan_card("wan-tiny", cfg_dispatch="sequential"))


def test_a_request_whose_tokens_sp_does_not_divide_is_refused(wan_card: Any) -> None:
    card = wan_card("wan2.1-t2v-1.3b")
    assert wan_tokens(card, 81, 480, 832) == 32760
    plan = ParallelPlan(ulysses=4, ring=2)
    request = Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                      diffusion=DiffusionParams(frames=81, height=480, width=832))
    WAN_PARALLEL.check_request(card, request, plan)  # 32760 = 8 x 4095
    odd = request.model_copy(update={"diffusion": DiffusionParams(frames=5, height=48, width=48)})  # 2 x 3 x 3 = 18 tokens
    assert wan_tokens(card, 5, 48, 48) == 18
    assert "does not divide the 18 tokens" in refused("ring", lambda: WAN_PARALLEL.check_request(card, odd, plan))


def test_deploy_refuses_a_bad_plan_before_any_process_group() -> None:
    from fv_kernel.api import build_engine

    config = DeployConfig(cards=[CardDeployment(model="wan-tiny")], parallel=ParallelPlan(sp=4))
    refused("ulysses", lambda: build_engine(config))
    config = DeployConfig(cards=[CardDeployment(model="fastwan-tiny")], parallel=ParallelPlan(cfgp=2))
    refused("cfgp", lambda: build_engine(config))
    assert not dist.is_initialized()


def test_parallel_vae_decode_refusals(wan_card: Any) -> None:
    plan = ParallelPlan(sp=2, vae=2)
    check_plan_against_card(plan, wan_card("wan-tiny"))
    # The Wan 2.2 VAE (residual up-blocks) is not split: the card declares vae 1.
    assert "max_degree['vae'] = 1" in refused("vae", lambda: check_plan_against_card(plan, wan_card("wan-tiny-ti2v")))
    assert "Wan 2.2 VAE" in refused("vae", lambda: WAN_PARALLEL.check_plan(wan_card("wan-tiny-ti2v"), plan))
    card = wan_card("wan-tiny")
    request = Request(model="wan-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                      diffusion=DiffusionParams(frames=5, height=32, width=32))
    WAN_PARALLEL.check_request(card, request, plan)  # 4 latent rows
    odd = request.model_copy(update={"diffusion": DiffusionParams(frames=5, height=24, width=32)})  # 3 rows, 12 tokens
    assert "does not divide the 3 latent rows" in refused("vae", lambda: WAN_PARALLEL.check_request(card, odd, plan))


def test_cuda_graphs_under_a_plan_are_refused_at_deploy_time() -> None:
    from fv_kernel.api import ComputeOptions, build_engine

    config = DeployConfig(cards=[CardDeployment(model="wan-tiny", compute=ComputeOptions(cuda_graphs=True))],
                          parallel=ParallelPlan(sp=2))
    assert "CUDA graphs" in refused("sp", lambda: build_engine(config))
    assert not dist.is_initialized()


def test_block_hooks_cannot_ride_the_spmd_broadcast() -> None:
    from fv_kernel.api import StepOp
    from fv_kernel.parallel import SpmdLeader

    class Instance:
        components: dict[str, Any] = {}

    leader = SpmdLeader(runtime=None, instances=[Instance()])  # type: ignore[arg-type]
    op = StepOp("dit_forward:transformer", lambda inputs, params: {})
    text = refused("sp", lambda: leader.call(0, op.name, op, {}, {"block_hooks": object()}))
    assert "block hooks" in text and leader.ledger == []


def test_the_deploy_example_in_docs_parallelism_md_passes_the_plan_check() -> None:
    import re
    from pathlib import Path

    import yaml

    from fv_kernel.deploy.parallel import check_deploy_plan
    from fv_kernel.plugins import PluginHost

    text = (Path(__file__).resolve().parents[3] / "docs" / "parallelism.md").read_text()
    block = re.search(r"```yaml\n(# deploy.yaml\n.*?)```", text, flags=re.S)
    assert block is not None
    config = DeployConfig.model_validate(yaml.safe_load(block.group(1)))
    assert config.parallel == ParallelPlan(sp=2) and config.cards[0].device == "cuda"
    check_deploy_plan(config, PluginHost())
    # The comment's alternative is valid too, and ulysses 8 is not (12 heads).
    check_deploy_plan(config.model_copy(update={"parallel": ParallelPlan(sp=2, cfgp=2)}), PluginHost())
    refused("ulysses", lambda: check_deploy_plan(config.model_copy(update={"parallel": ParallelPlan(sp=8)}), PluginHost()))
