"""Parallelism as a card contract (design §8): plans, meshes, sequence-parallel attention, SPMD.

See ``docs/parallelism.md``. Nothing here knows a model family: a card names its family's
parallel implementation (``parallelism.implementation``) and the kernel compiles the plan,
checks it against the card and runs every rank's share of each step.
"""

from fv_kernel.parallel.attention import (
    SequenceParallelAttention,
    gather_sequence,
    ring_attention,
    shard_sequence,
    ulysses_heads_to_seq,
    ulysses_seq_to_heads,
)
from fv_kernel.parallel.halo import halo_exchange
from fv_kernel.parallel.mesh import ParallelRuntime, compile_mesh, init_process_group_from_env
from fv_kernel.parallel.plan import MESH_ORDER, ParallelPlan, ParallelPlanError, check_plan_against_card, plan_axis_degrees
from fv_kernel.parallel.spmd import Decision, ParallelImplementation, RankFailure, SpmdLeader, parallel_instance, serve_worker

__all__ = [
    "MESH_ORDER",
    "ParallelPlan",
    "ParallelPlanError",
    "check_plan_against_card",
    "plan_axis_degrees",
    "ParallelRuntime",
    "compile_mesh",
    "init_process_group_from_env",
    "SequenceParallelAttention",
    "ring_attention",
    "ulysses_seq_to_heads",
    "ulysses_heads_to_seq",
    "shard_sequence",
    "gather_sequence",
    "halo_exchange",
    "Decision",
    "ParallelImplementation",
    "RankFailure",
    "SpmdLeader",
    "parallel_instance",
    "serve_worker",
]
