"""Mesh compile and the sequence-parallel primitives on 4 gloo processes (one launch per module).

Each rank compiles plans to DeviceMeshes (degree-one axes are trivial one-rank groups) and
runs Ulysses, ring and USP attention on its chunk of seeded random q/k/v; the tests compare
every rank's output with whole-sequence attention computed locally.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_kernel.parallel.launch import LaunchError, spawn

HEADS, TOKENS, DIM = 4, 24, 8


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, HEADS, TOKENS, DIM, generator=generator) for _ in range(3))  # type: ignore[return-value]


def run_rank(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.nn.functional as F

    from fv_kernel.parallel import ParallelPlan, SequenceParallelAttention, compile_mesh, gather_sequence, shard_sequence
    from fv_kernel.parallel.mesh import init_process_group_from_env

    report: dict[str, Any] = {}
    q, k, v = _qkv()
    full = F.scaled_dot_product_attention(q, k, v)
    for name, plan in {"ulysses4": ParallelPlan(sp=4), "ring4": ParallelPlan(ring=4), "usp2x2": ParallelPlan(ulysses=2, ring=2),
                       "sp2_cfgp2": ParallelPlan(sp=2, cfgp=2)}.items():
        init_process_group_from_env(plan, "cpu")
        runtime = compile_mesh(plan, "cpu")
        sizes = {axis: runtime.axis_size(axis) for axis in ("dp", "cfgp", "ring", "ulysses", "tp", "sp", "replica")}
        ranks = {axis: dist.get_process_group_ranks(runtime.group(axis)) for axis in ("ulysses", "ring", "sp", "cfgp")}
        sp_group = runtime.group("sp")
        attention = SequenceParallelAttention(runtime.group("ulysses"), runtime.group("ring"), F.scaled_dot_product_attention)
        local = attention(*(shard_sequence(t, 2, sp_group) for t in (q, k, v)))
        out = gather_sequence(local, 2, sp_group)
        report[name] = {"sizes": sizes, "ranks": ranks, "max_diff": float((out - full).abs().max())}
    return report


@pytest.fixture(scope="module")
def pool_4() -> list[dict[str, Any]]:
    return spawn(run_rank, 4, timeout_s=600)


def test_degree_one_axes_are_trivial_groups(pool_4: list[dict[str, Any]]) -> None:
    for report in pool_4:
        assert report["ulysses4"]["sizes"] == {"dp": 1, "cfgp": 1, "ring": 1, "ulysses": 4, "tp": 1, "sp": 4, "replica": 4}
        assert report["sp2_cfgp2"]["sizes"] == {"dp": 1, "cfgp": 2, "ring": 1, "ulysses": 2, "tp": 1, "sp": 2, "replica": 4}


def test_groups_follow_the_mesh_order(pool_4: list[dict[str, Any]]) -> None:
    # Ulysses is innermost: ranks 0,1 share a Ulysses group, 0,2 a ring (or cfgp) group.
    assert pool_4[0]["usp2x2"]["ranks"] == {"ulysses": [0, 1], "ring": [0, 2], "sp": [0, 1, 2, 3], "cfgp": [0]}
    assert pool_4[3]["usp2x2"]["ranks"] == {"ulysses": [2, 3], "ring": [1, 3], "sp": [0, 1, 2, 3], "cfgp": [3]}
    assert pool_4[1]["sp2_cfgp2"]["ranks"] == {"ulysses": [0, 1], "ring": [1], "sp": [0, 1], "cfgp": [1, 3]}


@pytest.mark.parametrize("plan", ["ulysses4", "ring4", "usp2x2", "sp2_cfgp2"])
def test_sequence_parallel_attention_equals_whole_sequence_attention(pool_4: list[dict[str, Any]], plan: str) -> None:
    for rank, report in enumerate(pool_4):
        assert report[plan]["max_diff"] < 1e-5, f"rank {rank} {plan}: {report[plan]['max_diff']}"


def _hang(rank: int) -> None:
    import time

    if rank == 1:
        time.sleep(60)


def test_the_launcher_bounds_a_hung_rank_and_ends_its_processes() -> None:
    import multiprocessing

    with pytest.raises(LaunchError, match="timed out"):
        spawn(_hang, 2, timeout_s=5)
    assert multiprocessing.active_children() == []


def _rendezvous(rank: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    dist.barrier()
    return dist.get_world_size()


def test_a_rendezvous_port_taken_before_rank_0_binds_it_is_retried_on_a_new_port(monkeypatch: pytest.MonkeyPatch) -> None:
    # In CI, parallel tox envs race for ports: the port free_port() saw free was bound by another
    # process before rank 0's store bound it, rank 0 failed with EADDRINUSE and the others waited
    # out their 120 s connect timeout. Here the first port handed out is held open by the test.
    import socket

    from fv_kernel.parallel import launch

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = [held.getsockname()[1]]
    real_free_port = launch.free_port

    def first_taken() -> int:
        port = ports.pop(0) if ports else real_free_port()
        handed.append(port)
        return port

    handed: list[int] = []
    monkeypatch.setattr(launch, "free_port", first_taken)
    try:
        assert spawn(_rendezvous, 2, timeout_s=100) == [2, 2]
    finally:
        held.close()
    assert len(handed) == 2 and handed[0] != handed[1]
    with pytest.raises(ValueError, match="port_attempts must be at least 1, got 0"):
        spawn(_rendezvous, 2, port_attempts=0)
    # The same launch allowed no second attempt fails at once, naming the taken port.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports.append(held.getsockname()[1])
    try:
        with pytest.raises(LaunchError, match=f"taken 1 times in a row: rank 0 on port {ports[0]}"):
            spawn(_rendezvous, 2, timeout_s=100, port_attempts=1)
    finally:
        held.close()


def test_the_rings_partial_attention_is_chunked_over_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.functional as F

    from fv_kernel.parallel import attention

    q, k, v = _qkv()
    whole, whole_lse = attention._attend_with_lse(q, k, v)
    monkeypatch.setattr(attention, "_SCORE_ELEMENTS", 2 * HEADS * TOKENS * 5)  # 5 query rows a chunk
    chunked, chunked_lse = attention._attend_with_lse(q, k, v)
    assert torch.allclose(chunked, whole, atol=1e-6) and torch.allclose(chunked_lse, whole_lse, atol=1e-6)
    assert torch.allclose(chunked, F.scaled_dot_product_attention(q, k, v), atol=1e-5)
