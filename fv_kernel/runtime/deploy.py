"""Build a running deployment (host, catalog, engine, resident instances) from a deploy config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fv_kernel.card.catalog import CardCatalog
from fv_kernel.card.instance import InstanceOptions, build_instance
from fv_kernel.config import CardDeployment, DeployConfig
from fv_kernel.plugins.host import PluginHost
from fv_kernel.plugins.registry import DeployRegistry
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.runtime.engine import Engine

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.parallel.launch import LocalWorkers

__all__ = ["build_engine", "engine_for", "available_extensions", "deployment_options"]


def available_extensions(host: PluginHost) -> dict[str, type]:
    """Interceptor and observer classes of the enabled plugins, by short name (``plugin_id`` for interceptors)."""
    host.start()
    found: dict[str, type] = {}
    for contribution in [*host.hooks.interceptors().values(), *host.hooks.observers().values()]:
        found[contribution.name] = contribution.obj  # type: ignore[assignment]
    return found


def deployment_options(deployment: CardDeployment, registry: DeployRegistry, *, source: str | None = None) -> InstanceOptions:
    """The instance options of one configured card, carrying the deploy registry names resolve through.

    The attention backend is checked against the enabled plugins' drivers now (metadata
    only, nothing imported), so a backend of a disabled or missing plugin is an error at
    deploy time naming why, not at the first request.
    """
    registry.attention_backends.entry_point(deployment.attention_backend)
    return InstanceOptions(
        device=deployment.device, precision=deployment.precision, source=source,
        local_files_only=deployment.local_files_only, attention_backend=deployment.attention_backend,
        compute=deployment.compute, allow_recipe_mismatch=deployment.override_recipe, registry=registry,
    )


def engine_for(config: DeployConfig, host: PluginHost) -> Engine:
    """An engine with the config's scheduler, limits and extensions and the host's hooks; no instances yet."""
    extensions = ExtensionSet.build(config.extensions, available_extensions(host))
    return Engine(config.scheduler, limits=config.limits, hooks=host.hooks, extensions=extensions)


def build_engine(config: DeployConfig, host: PluginHost | None = None, *, launcher: LocalWorkers | None = None) -> Engine:
    """Start the plugin host the config selects, then make every configured card resident.

    With a multi-rank ``parallel:`` plan this is rank 0's side of
    :func:`fv_kernel.parallel.deploy.deploy_parallel` (the other ranks serve through it);
    ``launcher`` is fv's spawn of those ranks, if it started them (it can restart them).
    """
    if host is None:
        host = PluginHost(config.plugins)
    host.start()
    if config.parallel is not None:
        from fv_kernel.parallel.deploy import check_deploy_plan, deploy_parallel
        from fv_kernel.parallel.plan import ParallelPlanError

        if config.parallel.world_size > 1:
            deployed = deploy_parallel(config, host, launcher=launcher)
            if deployed.engine is None:
                raise ParallelPlanError("world_size", f"rank {deployed.runtime.rank} is a worker of the pool: it serves "
                                        "through deploy_parallel(...).serve(), not build_engine", allowed="rank 0")
            return deployed.engine
        check_deploy_plan(config, host)
    catalog = CardCatalog(host)
    engine = engine_for(config, host)
    for deployment in config.cards:
        resolved = catalog.resolve(deployment.model)
        options = deployment_options(deployment, host.registry(), source=resolved.source)
        engine.add_instance(build_instance(resolved.card, options))
    return engine
