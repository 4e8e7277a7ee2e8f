"""Deploy a config with a multi-rank ``parallel:`` plan: every rank calls :func:`deploy_parallel`.

Order (pre-flight, never halfway): the plan is checked against every card before a process
group exists; then the process group and mesh; then instances whose ops run their share.
Rank 0 gets an :class:`SpmdEngine`; the other ranks call :meth:`ParallelDeployment.serve`
and return when rank 0 shuts the pool down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from fv_kernel.config import DeployConfig
from fv_kernel.deploy.options import available_extensions, deployment_options
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.model.catalog import CardCatalog
from fv_kernel.model.instance import ModelInstance, build_instance
from fv_kernel.parallel.engine import SpmdEngine
from fv_kernel.parallel.mesh import ParallelRuntime, compile_mesh, init_process_group_from_env
from fv_kernel.parallel.plan import ParallelPlan, ParallelPlanError, check_plan_against_card, plan_axis_degrees
from fv_kernel.parallel.spmd import SpmdLeader, WorkerReport, parallel_instance, serve_worker
from fv_kernel.plugins.host import PluginHost

__all__ = ["ParallelDeployment", "RankLauncher", "deploy_parallel", "check_deploy_plan"]

log = logging.getLogger(__name__)


class RankLauncher(Protocol):
    """Rank 0's handle on the worker ranks it started itself (:class:`~fv_kernel.deploy.workers.LocalWorkers`)."""

    def restart(self) -> None:
        """End every worker rank and start fresh ones (on a new rendezvous port)."""
        ...


@dataclass
class ParallelDeployment:
    runtime: ParallelRuntime
    instances: list[ModelInstance]
    #: Rank 0's engine; None on the other ranks.
    engine: SpmdEngine | None = None
    report: WorkerReport = field(default_factory=WorkerReport)

    def serve(self) -> WorkerReport:
        """A worker rank: run rank 0's decisions until it shuts the pool down."""
        if self.engine is not None:
            raise RuntimeError("rank 0 runs the engine, not serve()")
        self.report = serve_worker(self.runtime, self.instances)
        return self.report

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.leader.shutdown()


def check_deploy_plan(config: DeployConfig, host: PluginHost) -> list:
    """Resolve every card and check the plan against it; returns the resolved cards. No process group needed."""
    plan = config.parallel
    assert plan is not None
    catalog = CardCatalog(host)
    resolved = [catalog.resolve(deployment.model) for deployment in config.cards]
    for item in resolved:
        check_plan_against_card(plan, item.card)
    if plan.world_size > 1:
        axis = next(name for name, degree in plan_axis_degrees(plan).items() if degree > 1)
        for deployment in config.cards:
            if deployment.compute is not None and deployment.compute.cuda_graphs:
                raise ParallelPlanError(axis, f"card {deployment.model!r} asks for CUDA graphs (compute.cuda_graphs), "
                                        "which are not captured across ranks", allowed="compute.cuda_graphs false")
    devices = {deployment.device.split(":")[0] for deployment in config.cards}
    if len(devices) > 1:
        raise ParallelPlanError("world_size", f"cards of one pool must share a device type, got {sorted(devices)}")
    return resolved


def deploy_parallel(config: DeployConfig, host: PluginHost | None = None, *,
                    launcher: RankLauncher | None = None) -> ParallelDeployment:
    """Every rank's deployment. ``launcher``: rank 0's handle on the ranks it started (fv's
    spawn), which lets it restart them after a rank fails (``SpmdLeader.recover``)."""
    plan: ParallelPlan | None = config.parallel
    if plan is None:
        raise ParallelPlanError("world_size", "the deploy config has no parallel: section")
    if host is None:
        host = PluginHost(config.plugins)
    host.start()
    resolved = check_deploy_plan(config, host)
    device_type = config.cards[0].device.split(":")[0] if config.cards else "cpu"
    init_process_group_from_env(plan, device_type)
    runtime = compile_mesh(plan, device_type)
    leader: SpmdLeader | None = None
    instances: list[ModelInstance] = []
    if runtime.is_leader:
        leader = SpmdLeader(runtime, instances)
    for index, (deployment, item) in enumerate(zip(config.cards, resolved)):
        options = deployment_options(deployment, host.registry(), source=item.source)
        if device_type == "cuda":  # each rank its own GPU
            options = options.model_copy(update={"device": str(runtime.device)})
        instances.append(parallel_instance(build_instance(item.card, options), runtime, index=index, leader=leader))
    if leader is None:
        return ParallelDeployment(runtime=runtime, instances=instances)
    if launcher is not None:
        def restart_pool() -> ParallelRuntime:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - a group with a dead peer may not tear down cleanly
                log.warning("tearing down the failed process group: %s", exc)
            launcher.restart()
            init_process_group_from_env(plan, device_type)
            return compile_mesh(plan, device_type)

        leader.recover = restart_pool
    extensions = ExtensionSet.build(config.extensions, available_extensions(host))
    engine = SpmdEngine(config.scheduler, limits=config.limits, hooks=host.hooks, extensions=extensions, leader=leader)
    for instance in instances:
        engine.add_instance(instance)
    return ParallelDeployment(runtime=runtime, instances=instances, engine=engine)
