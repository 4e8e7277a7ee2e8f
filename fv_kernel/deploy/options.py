"""What a deploy config gives each card's instance: its options, and the enabled extensions."""

from __future__ import annotations

from fv_kernel.config import CardDeployment
from fv_kernel.model.options import InstanceOptions
from fv_kernel.plugins.host import PluginHost
from fv_kernel.plugins.registry import DeployRegistry

__all__ = ["available_extensions", "deployment_options"]


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
        device=deployment.device, precision=deployment.precision, precision_path=deployment.precision_path, source=source,
        local_files_only=deployment.local_files_only, attention_backend=deployment.attention_backend,
        compute=deployment.compute, component_sources=dict(deployment.component_sources),
        allow_recipe_mismatch=deployment.override_recipe, registry=registry,
    )
