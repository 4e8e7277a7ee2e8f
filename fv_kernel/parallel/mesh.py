"""Compile a :class:`ParallelPlan` to a torch ``DeviceMesh`` over an initialised process group.

Every axis of ``MESH_ORDER`` is a mesh dimension, degree-one ones included, so component
code asks for ``runtime.group("ulysses")`` and gets a trivial one-rank group when the
axis is off: no special cases. Two flattened groups are derived: ``sp`` (ring x ulysses,
the order tokens are laid out in) and ``replica`` (every rank of one dp replica, which the
VAE decode and the SPMD broadcast use).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fv_kernel.parallel.plan import MESH_ORDER, ParallelPlan, ParallelPlanError

__all__ = ["ParallelRuntime", "compile_mesh", "init_process_group_from_env"]


@dataclass
class ParallelRuntime:
    """One rank's view of the compiled plan: the mesh, its groups and this rank's coordinates."""

    plan: ParallelPlan
    mesh: DeviceMesh
    rank: int
    world_size: int
    #: Device collectives run on (``cpu`` for gloo, this rank's ``cuda:N`` for NCCL).
    device: torch.device
    _groups: dict[str, Any] = field(default_factory=dict)

    def group(self, axis: str) -> Any:
        """The process group of ``axis`` (a ``MESH_ORDER`` name, ``"sp"`` or ``"replica"``) this rank is in."""
        if axis not in self._groups:
            raise ParallelPlanError(axis, "no such mesh axis", allowed=", ".join([*MESH_ORDER, "sp", "replica"]))
        return self._groups[axis]

    def axis_rank(self, axis: str) -> int:
        return dist.get_rank(self.group(axis))

    def axis_size(self, axis: str) -> int:
        return dist.get_world_size(self.group(axis))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def compile_mesh(plan: ParallelPlan, device_type: str = "cpu") -> ParallelRuntime:
    """Build the mesh of ``plan`` over the default process group (which must match its world size)."""
    if not dist.is_initialized():
        raise ParallelPlanError("world_size", "no process group: launch with torchrun or fv's spawn launcher")
    plan.check_world(dist.get_world_size())
    mesh = init_device_mesh(device_type, plan.mesh_shape(), mesh_dim_names=MESH_ORDER)
    groups: dict[str, Any] = {axis: mesh.get_group(axis) for axis in MESH_ORDER}
    groups["sp"] = mesh["ring", "ulysses"]._flatten("sp").get_group()
    groups["replica"] = mesh["cfgp", "ring", "ulysses", "tp"]._flatten("replica").get_group()
    rank = dist.get_rank()
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    return ParallelRuntime(plan=plan, mesh=mesh, rank=rank, world_size=dist.get_world_size(), device=device, _groups=groups)


def init_process_group_from_env(plan: ParallelPlan, device_type: str) -> None:
    """Join the default process group torchrun (or fv's spawn) described in the environment."""
    if dist.is_initialized():
        return
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ParallelPlanError("world_size", f"the plan needs {plan.world_size} processes but the launcher environment "
                                f"lacks {missing}", allowed="torchrun --nproc-per-node N fv serve ..., or fv serve's own spawn")
    backend = plan.backend or ("nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":  # each rank its own GPU, whichever backend
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=plan.timeout_s))
