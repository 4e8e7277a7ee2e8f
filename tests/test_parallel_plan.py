"""The parallel plan contract: every bad plan is refused up front with a typed error naming its axis.

No process group is needed for any of this: plans are checked alone, against the world they
are launched into, and against each card of the deployment, before anything is started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from fv_kernel.card.spec import ModelCard
from fv_kernel.config import CardDeployment, DeployConfig, DeployConfigError, load_deploy_config
from fv_kernel.plugins.hookspecs import hookimpl
from fv_kernel.parallel import MESH_ORDER, ParallelPlan, ParallelPlanError, check_plan_against_card
from fv_kernel.testing.toy import toy_card


class RecordingImplementation:
    """A card's parallel implementation that records what the kernel asked it to check."""

    def __init__(self) -> None:
        self.checked: list[tuple[str, str]] = []

    def check_plan(self, card: ModelCard, plan: ParallelPlan) -> None:
        self.checked.append((card.model_id, plan.label()))
        if plan.ulysses and plan.ulysses > 2:
            raise ParallelPlanError("ulysses", "the toy has 2 heads", allowed="1, 2")

    def check_request(self, card: ModelCard, request: Any, plan: ParallelPlan) -> None:
        return None

    def build_ops(self, instance: Any, runtime: Any) -> dict[str, Any]:
        raise AssertionError("not built in these tests")

    def is_collective(self, op_name: str, plan: ParallelPlan) -> bool:
        return True


IMPLEMENTATION = RecordingImplementation()


def parallel_card(*, axes: tuple[str, ...] = ("sp", "cfgp"), max_degree: dict[str, int] | None = None,
                  implementation: str | None = "test_parallel_plan:IMPLEMENTATION", **denoise_config: Any) -> ModelCard:
    data = toy_card("toy-dit").model_dump()
    data["loops"]["denoise"]["valid_parallel_axes"] = axes
    data["loops"]["denoise"]["config"].update(denoise_config)
    data["parallelism"] = {"max_degree": max_degree if max_degree is not None else {"sp": 4, "cfgp": 2},
                           "implementation": implementation}
    return ModelCard.model_validate(data)


def refused(axis: str, build: Any) -> ParallelPlanError:
    with pytest.raises(ParallelPlanError) as info:
        build()
    assert info.value.axis == axis and info.value.param == f"parallel.{axis}", info.value
    assert str(info.value).startswith(f"parallel.{axis}: ")
    return info.value


# -- the plan alone ---------------------------------------------------------------------------

def test_cfgp_above_two_is_refused() -> None:
    assert "allowed: 1 or 2" in str(refused("cfgp", lambda: ParallelPlan(cfgp=3)))


@pytest.mark.parametrize("axis", ["dp", "sp", "ulysses", "ring", "cfgp", "tp", "vae"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "two", True])
def test_a_degree_that_is_not_a_positive_integer_names_its_axis(axis: str, value: Any) -> None:
    refused(axis, lambda: ParallelPlan(**{axis: value}))


def test_sp_must_equal_ulysses_times_ring() -> None:
    error = refused("sp", lambda: ParallelPlan(sp=4, ulysses=2, ring=1))
    assert "ulysses x ring = 2 x 1 = 2" in str(error)
    refused("sp", lambda: ParallelPlan(sp=6, ring=4))
    # One factor given: the other is implied; none given: sp is all Ulysses.
    assert (ParallelPlan(sp=4, ring=2).ulysses, ParallelPlan(sp=4, ulysses=2).ring) == (2, 2)
    assert (ParallelPlan(sp=4).ulysses, ParallelPlan(sp=4).ring) == (4, 1)
    assert ParallelPlan(ulysses=2, ring=2).sp == 4


def test_vae_splits_over_a_whole_replica_or_nothing() -> None:
    error = refused("vae", lambda: ParallelPlan(sp=4, vae=2))
    assert "allowed: 1 or 4" in str(error)
    assert ParallelPlan(sp=2, cfgp=2, vae=4).vae == 4


def test_the_world_size_is_the_product_of_the_degrees() -> None:
    plan = ParallelPlan(sp=2, cfgp=2)
    assert plan.world_size == 4 and plan.mesh_shape() == (1, 2, 1, 2, 1)
    assert dict(zip(MESH_ORDER, plan.mesh_shape())) == {"dp": 1, "cfgp": 2, "ring": 1, "ulysses": 2, "tp": 1}
    error = refused("world_size", lambda: plan.check_world(2))
    assert "4 processes but 2 were launched" in str(error)
    plan.check_world(4)


def test_a_sequence_degree_that_does_not_divide_the_tokens_is_refused() -> None:
    refused("ring", lambda: ParallelPlan(ulysses=2, ring=3).check_tokens(20))
    refused("ulysses", lambda: ParallelPlan(sp=4).check_tokens(6))
    ParallelPlan(ulysses=2, ring=3).check_tokens(24)


# -- the plan against the card ------------------------------------------------------------------

def test_a_plan_within_the_card_passes_and_reaches_the_family_check() -> None:
    card = parallel_card()
    IMPLEMENTATION.checked.clear()
    check_plan_against_card(ParallelPlan(sp=2, cfgp=2), card)
    assert IMPLEMENTATION.checked == [("toy-dit", ParallelPlan(sp=2, cfgp=2).label())]
    refused("ulysses", lambda: check_plan_against_card(ParallelPlan(sp=4), card))  # the family's refusal


def test_a_single_device_plan_needs_nothing_from_the_card() -> None:
    check_plan_against_card(ParallelPlan(), toy_card("toy-dit"))


def test_an_axis_no_loop_lists_is_refused() -> None:
    card = parallel_card(axes=("cfgp",), max_degree={"cfgp": 2})
    assert "lists 'sp' on none of its loops" in str(refused("sp", lambda: check_plan_against_card(ParallelPlan(sp=2), card)))
    refused("tp", lambda: check_plan_against_card(ParallelPlan(tp=2), card))


def test_a_degree_above_the_cards_max_is_refused() -> None:
    card = parallel_card(max_degree={"sp": 2, "cfgp": 2})
    error = refused("sp", lambda: check_plan_against_card(ParallelPlan(ulysses=2, ring=2), card))
    assert "above card 'toy-dit'" in str(error) and "allowed: 1..2" in str(error)


def test_dp_inside_one_engine_is_refused() -> None:
    card = parallel_card(axes=("sp", "cfgp", "dp"), max_degree={"dp": 2})
    assert "one pool per replica" in str(refused("dp", lambda: check_plan_against_card(ParallelPlan(dp=2), card)))


def test_cfgp_on_a_card_without_guidance_is_refused() -> None:
    data = parallel_card().model_dump()
    data["capabilities"]["uses_guidance"] = False
    data["capabilities"]["defaults"]["guidance"] = 1.0
    card = ModelCard.model_validate(data)
    assert "no classifier-free guidance" in str(refused("cfgp", lambda: check_plan_against_card(ParallelPlan(cfgp=2), card)))
    data = parallel_card().model_dump()
    data["loops"]["denoise"]["guidance"] = "none"
    card = ModelCard.model_validate(data)
    assert "guidance 'none'" in str(refused("cfgp", lambda: check_plan_against_card(ParallelPlan(cfgp=2), card)))


def test_cfg_owned_by_batched_dispatch_and_a_cfgp_group_is_a_build_error() -> None:
    card = parallel_card(cfg_dispatch="batched")
    error = refused("cfgp", lambda: check_plan_against_card(ParallelPlan(cfgp=2), card))
    assert "owns CFG by a batched dispatch" in str(error)
    # Negative control: the same card with sequential dispatch is accepted.
    check_plan_against_card(ParallelPlan(cfgp=2), parallel_card(cfg_dispatch="sequential"))
    # And batched CFG without a cfgp group is fine too.
    check_plan_against_card(ParallelPlan(sp=2), card)


def test_a_card_without_an_implementation_cannot_take_a_degree() -> None:
    data = parallel_card().model_dump()
    data["parallelism"] = {"max_degree": {}}
    data["loops"]["denoise"]["valid_parallel_axes"] = ("sp",)
    card = ModelCard.model_validate(data)
    refused("sp", lambda: check_plan_against_card(ParallelPlan(sp=2), card))


# -- the deploy config ---------------------------------------------------------------------------

def test_a_bad_parallel_section_in_the_deploy_yaml_is_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("cards: [toy-dit]\nparallel:\n  cfgp: 3\n")
    with pytest.raises((ParallelPlanError, DeployConfigError)) as info:
        load_deploy_config(path)
    assert "parallel" in str(info.value) and "cfgp" in str(info.value)
    path.write_text("cards: [toy-dit]\nparallel:\n  sp: 2\n  warp: 2\n")
    with pytest.raises(DeployConfigError, match="parallel.warp"):
        load_deploy_config(path)
    path.write_text("cards: [toy-dit]\nparallel:\n  ulysses: 2\n  ring: 2\n")
    assert load_deploy_config(path).parallel == ParallelPlan(sp=4, ulysses=2, ring=2)


class _ToyCards:
    @hookimpl
    def fv_register_model_cards(self, register: Any) -> None:
        register("toy-dit", toy_card("toy-dit"))
        register("toy-parallel", parallel_card(cfg_dispatch="batched").model_copy(update={"model_id": "toy-parallel"}))


def test_build_engine_checks_the_plan_against_each_card_before_any_process_group(register_plugin: Any) -> None:
    from fv_kernel.deploy.engine import build_engine

    host = register_plugin(_ToyCards(), name="toy-cards")
    # toy-dit lists no parallel axes: refused at deploy time, before a process group exists.
    config = DeployConfig(cards=[CardDeployment(model="toy-dit")], parallel=ParallelPlan(sp=2))
    error = refused("sp", lambda: build_engine(config, host=host))
    assert "none of its loops" in str(error)
    # Every card of the pool is checked: the second one owns CFG by batched dispatch.
    config = DeployConfig(cards=[CardDeployment(model="toy-parallel")], parallel=ParallelPlan(cfgp=2))
    assert "batched dispatch" in str(refused("cfgp", lambda: build_engine(config, host=host)))
    assert not dist.is_initialized()
    # A trivial plan deploys as a plain engine.
    engine = build_engine(DeployConfig(cards=[CardDeployment(model="toy-dit")], parallel=ParallelPlan()), host=host)
    assert "toy-dit" in engine.instances


def test_fv_generate_refuses_a_multi_rank_plan_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fv_kernel.cli.app import app

    config = tmp_path / "deploy.yaml"
    config.write_text("parallel:\n  sp: 2\n")
    result = CliRunner().invoke(app, ["generate", "--config", str(config), "-p", "x", "-o", str(tmp_path / "v.mp4"), "-q"])
    assert result.exit_code == 2
    assert "parallel: fv generate runs one process; a plan of 2 ranks is served by fv serve" in result.output
    assert not (tmp_path / "v.mp4").exists()
