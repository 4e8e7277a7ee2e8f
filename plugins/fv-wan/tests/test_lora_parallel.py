"""Adapters under parallel plans: wan-tiny's sequence-parallel (Ulysses sp=2) and CFG-parallel
(cfgp=2) DiT forward on 2 gloo processes gives every row its own adapters, equal to the
single-process per-row forward within 1e-5 (negative control: the op built without the
instance, so without routing, is far off)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fv_kernel.parallel.launch import spawn

TOLERANCE = 1e-5


def _rank(rank: int, folder: str, plans: dict[str, dict[str, int]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from fv_kernel.api import AdapterRef, DiffusionParams, Request, TaskType, TextPart, build_instance, rows_adapted
    from fv_kernel.parallel import ParallelPlan
    from fv_kernel.parallel.mesh import compile_mesh
    from fv_wan.cards import wan_cards
    from fv_wan.parallel import parallel_dit_op
    from wan_lora_files import wan_registry

    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    instance = build_instance(card)
    mine = Path(folder) / f"rank{rank}"
    mine.mkdir()
    instance.adapters = wan_registry(instance, mine)
    model = instance.component("transformer")
    stacks = [(AdapterRef(name="style", scale=0.8),), (AdapterRef(name="sketch"), AdapterRef(name="ink", scale=0.5)),
              (), (AdapterRef(name="ink"),)]
    adapter_rows = [
        instance.adapter_inputs(Request(model="wan-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                                        diffusion=DiffusionParams(), adapters=stack), "transformer")
        for stack in stacks
    ]
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "x": torch.randn(4, 16, 2, 4, 4, generator=generator), "t": torch.tensor([900.0, 500.0, 300.0, 10.0]),
        "context": torch.randn(4, 16, 32, generator=generator),
        **{k: torch.cat([row[k] for row in adapter_rows]) for k in ("adapter_ids", "adapter_scales")},
    }
    report: dict[str, Any] = {}
    with torch.no_grad():
        if rank == 0:
            with rows_adapted(model, instance.row_adapters(inputs, "transformer")):
                report["reference"] = model(inputs["x"], inputs["t"], inputs["context"]).numpy()
        from fv_kernel.parallel.mesh import init_process_group_from_env

        for name, plan_fields in plans.items():
            plan = ParallelPlan(**plan_fields)
            if not dist.is_initialized():
                init_process_group_from_env(plan, "cpu")
            runtime = compile_mesh(plan)
            for dispatch in ("batched", "sequential"):
                params = {"dispatch": dispatch}
                out = parallel_dit_op("transformer", model, runtime, instance=instance).fn(inputs, params)["v"]
                report[f"{name}-{dispatch}"] = out.numpy()
            report[f"{name}-unrouted"] = parallel_dit_op("transformer", model, runtime).fn(inputs, {"dispatch": "batched"})["v"].numpy()
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("parallel-loras")
    return spawn(_rank, 2, (str(folder), {"sp2": {"sp": 2}, "cfgp2": {"cfgp": 2}}), timeout_s=600)


@pytest.mark.parametrize("plan", ["sp2", "cfgp2"])
@pytest.mark.parametrize("dispatch", ["batched", "sequential"])
def test_each_row_gets_its_adapters_under_the_plan(reports: list[dict[str, Any]], plan: str, dispatch: str) -> None:
    reference = reports[0]["reference"]
    for report in reports:
        assert np.abs(report[f"{plan}-{dispatch}"] - reference).max() <= TOLERANCE


@pytest.mark.parametrize("plan", ["sp2", "cfgp2"])
def test_negative_control_without_routing_is_far_off(reports: list[dict[str, Any]], plan: str) -> None:
    assert np.abs(reports[0][f"{plan}-unrouted"] - reports[0]["reference"]).max() > 1e-2
