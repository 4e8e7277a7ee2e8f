"""Typed errors of the plugin host. Every message names what failed and why."""

from __future__ import annotations


class PluginError(Exception):
    """Base class of every plugin-host error."""


class ManifestError(PluginError):
    """A plugin manifest is missing, unreadable or invalid."""


class KernelAPIMismatchError(PluginError):
    """A plugin's declared ``kernel_api`` range excludes this kernel's API version."""

    def __init__(self, plugin: str, required: str, kernel_api: str) -> None:
        self.plugin = plugin
        self.required = required
        self.kernel_api = kernel_api
        super().__init__(
            f"plugin {plugin!r} requires kernel API {required!r}, "
            f"but this kernel provides API version {kernel_api!r}"
        )


class PluginLoadError(PluginError):
    """A plugin that had to load (explicitly enabled, or ``strict``) failed to load."""

    def __init__(self, distribution: str, version: str | None, entry_point: str | None, cause: str) -> None:
        self.distribution = distribution
        self.version = version
        self.entry_point = entry_point
        self.cause = cause
        super().__init__(
            f"plugin {distribution} {version or '<unknown version>'} "
            f"(entry point {entry_point or '<none>'}) failed to load: {cause}"
        )


class DuplicateContributionError(PluginError):
    """Two plugins contribute the same short name for one kind."""


class UnknownContributionError(PluginError, LookupError):
    """A contribution id (namespaced or short) matches nothing, or is ambiguous."""


class UnknownDriverError(PluginError, LookupError):
    """A named driver is not registered in its entry-point group."""


class DriverTypeError(PluginError, TypeError):
    """A resolved driver or contribution does not satisfy its kind's abstract base."""


class PluginConfigError(PluginError, ValueError):
    """The deploy-scope plugin configuration (file or ``FV_PLUGINS``) is invalid."""


def one_line(exc: BaseException) -> str:
    """``"<Type>: <message>"`` on one line; a pydantic ValidationError lists ``field: message`` pairs.

    Plugin failures are reported as one CLI line or one warning, so no cause may span lines.
    """
    errors = getattr(exc, "errors", None)
    title = getattr(exc, "title", None)
    if callable(errors) and isinstance(title, str):  # pydantic.ValidationError, without importing pydantic here
        try:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in errors()
            )
            return f"{type(exc).__name__} in {title}: {problems}"
        except (TypeError, KeyError):
            pass
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
