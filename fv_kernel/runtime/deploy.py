"""Build a running deployment (host, catalog, engine, resident instances) from a deploy config."""

from __future__ import annotations

from fv_kernel.card.catalog import CardCatalog
from fv_kernel.card.instance import InstanceOptions, build_instance
from fv_kernel.config import DeployConfig
from fv_kernel.plugins.host import PluginHost
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.runtime.engine import Engine

__all__ = ["build_engine", "available_extensions"]


def available_extensions(host: PluginHost) -> dict[str, type]:
    """Interceptor and observer classes of the enabled plugins, by short name (``plugin_id`` for interceptors)."""
    host.start()
    found: dict[str, type] = {}
    for contribution in [*host.hooks.interceptors().values(), *host.hooks.observers().values()]:
        found[contribution.name] = contribution.obj  # type: ignore[assignment]
    return found


def build_engine(config: DeployConfig, host: PluginHost | None = None) -> Engine:
    """Start the plugin host the config selects, then make every configured card resident."""
    if host is None:
        host = PluginHost(config.plugins)
    host.start()
    catalog = CardCatalog(host)
    extensions = ExtensionSet.build(config.extensions, available_extensions(host))
    engine = Engine(config.scheduler, limits=config.limits, hooks=host.hooks, extensions=extensions)
    for deployment in config.cards:
        resolved = catalog.resolve(deployment.model)
        options = InstanceOptions(
            device=deployment.device, precision=deployment.precision, source=resolved.source,
            local_files_only=deployment.local_files_only, attention_backend=deployment.attention_backend,
            compute=deployment.compute, allow_recipe_mismatch=deployment.override_recipe,
        )
        engine.add_instance(build_instance(resolved.card, options))
    return engine
