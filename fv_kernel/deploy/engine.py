"""Build a running deployment (host, catalog, engine, resident instances) from a deploy config."""

from __future__ import annotations

from fv_kernel.cache.adapters import AdapterRegistry
from fv_kernel.card.spec import ModelCard
from fv_kernel.config import DeployConfig, DeployConfigError
from fv_kernel.deploy.options import available_extensions, deployment_options
from fv_kernel.deploy.parallel import RankLauncher, check_deploy_plan, deploy_parallel
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.model.adapters import convert_peft, converter_for
from fv_kernel.model.catalog import CardCatalog
from fv_kernel.model.instance import build_instance
from fv_kernel.parallel.plan import ParallelPlanError
from fv_kernel.plugins.host import PluginHost
from fv_kernel.runtime.engine import Engine

__all__ = ["build_engine", "engine_for", "adapter_registry"]


def adapter_registry(config: DeployConfig, cards: list[ModelCard]) -> AdapterRegistry | None:
    """The deployment's adapter registry (the config's ``adapters:`` section; None when it is off),
    with the files of ``adapters.directory`` registered. Files are read with the cards' converter
    (``ModelCard.adapter_format``), so the cards of one deployment must agree on it."""
    settings = config.adapters
    if settings is None or not settings.enabled:
        return None
    formats = sorted({card.adapter_format or "fv_kernel.model.adapters:convert_peft" for card in cards})
    if len(formats) > 1:
        raise DeployConfigError(
            f"adapters: the cards {sorted(card.model_id for card in cards)} read adapter files in different formats "
            f"({', '.join(formats)}); one deployment registers adapters for one format",
            param="adapters",
        )
    registry = AdapterRegistry(converter_for(cards[0]) if cards else convert_peft, settings)
    if settings.directory is not None:
        registry.scan(settings.directory)
    return registry


def engine_for(config: DeployConfig, host: PluginHost, *, adapters: AdapterRegistry | None = None) -> Engine:
    """An engine with the config's scheduler, limits and extensions and the host's hooks; no instances yet."""
    extensions = ExtensionSet.build(config.extensions, available_extensions(host))
    return Engine(config.scheduler, limits=config.limits, hooks=host.hooks, extensions=extensions, adapters=adapters)


def build_engine(config: DeployConfig, host: PluginHost | None = None, *, launcher: RankLauncher | None = None) -> Engine:
    """Start the plugin host the config selects, then make every configured card resident.

    With a multi-rank ``parallel:`` plan this is rank 0's side of
    :func:`fv_kernel.deploy.parallel.deploy_parallel` (the other ranks serve through it);
    ``launcher`` is fv's spawn of those ranks, if it started them (it can restart them).
    """
    if host is None:
        host = PluginHost(config.plugins)
    host.start()
    if config.parallel is not None:
        if config.parallel.world_size > 1:
            deployed = deploy_parallel(config, host, launcher=launcher)
            if deployed.engine is None:
                raise ParallelPlanError("world_size", f"rank {deployed.runtime.rank} is a worker of the pool: it serves "
                                        "through deploy_parallel(...).serve(), not build_engine", allowed="rank 0")
            return deployed.engine
        check_deploy_plan(config, host)
    catalog = CardCatalog(host)
    resolved = [(deployment, catalog.resolve(deployment.model)) for deployment in config.cards]
    engine = engine_for(config, host, adapters=adapter_registry(config, [r.card for _, r in resolved]))
    for deployment, model in resolved:
        options = deployment_options(deployment, host.registry(), source=model.source)
        engine.add_instance(build_instance(model.card, options))
    return engine
