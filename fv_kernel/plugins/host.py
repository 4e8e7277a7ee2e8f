"""The plugin host: discovery, deploy-scope selection, loading and failure policy."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import warnings
from dataclasses import dataclass, field
from enum import Enum
from importlib.metadata import EntryPoint
from typing import Mapping, Sequence

import pluggy
from packaging.utils import canonicalize_name

from fv_kernel import API_VERSION

from . import hookspecs
from .config import KERNEL_DISTRIBUTION, PluginsConfig, Selection, select
from .discovery import (
    PLUGINS_GROUP,
    DiscoveredPlugin,
    EntryPointScan,
    scan_entry_points,
    scan_kernel_distribution,
)
from .drivers import DriverRegistry, entry_point_distribution
from .errors import ManifestError, PluginConfigError, PluginError, PluginLoadError, one_line
from .hooks import PluginHooks
from .kinds import KINDS, KindSpec, kind_spec
from .manifest import PluginManifest, load_manifest, locate_manifest
from .registry import DeployRegistry


class PluginWarning(UserWarning):
    """An autoloaded plugin was skipped because it failed to load."""


class PluginStatus(str, Enum):
    ENABLED = "enabled"
    DISABLED = "disabled"
    ERROR = "error"


@dataclass
class PluginRecord:
    """What the host knows about one plugin; ``fv plugins list`` prints these."""

    name: str
    version: str | None
    entry_point: str | None
    status: PluginStatus
    reason: str = ""
    """Why it is enabled/disabled, or the error text when status is ``error``."""
    explicit: bool = False
    manifest: PluginManifest | None = None
    plugin: object | None = field(default=None, repr=False)

    @property
    def contributions(self) -> dict[str, list[str]]:
        """Declared contribution ids per kind, from the manifest (no import needed)."""
        return self.manifest.contribution_ids() if self.manifest else {}


class PluginHost:
    """Finds, selects and loads fv plugins into one pluggy manager.

    ``discover=False`` makes a hermetic host that sees no installed plugins (tests
    register plugin objects with :meth:`register`). Discovery reads metadata once per
    host; the process-wide host from :func:`get_host` therefore scans once per process.
    The kernel's built-ins (the ``fv-kernel`` distribution) are always loaded, found on
    the search path or not, unless ``kernel_builtins=False`` (checkers that look at one
    plugin alone). Nothing here initialises CUDA or reads weights; plugins are imported
    and registered by :meth:`start`.
    """

    def __init__(
        self,
        config: PluginsConfig | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        discover: bool = True,
        search_path: Sequence[str] | None = None,
        kinds: Mapping[str, KindSpec] = KINDS,
        kernel_api: str = API_VERSION,
        kernel_builtins: bool = True,
    ) -> None:
        base = config or PluginsConfig()
        self.config: PluginsConfig = base.with_env(os.environ if environ is None else environ)
        self.kernel_api = kernel_api
        self._discover = discover
        self._search_path = None if search_path is None else tuple(search_path)
        self._kinds = kinds
        self._kernel_builtins = kernel_builtins
        self._scan: EntryPointScan | None = None
        self._loadable_scan: EntryPointScan | None = None
        self._records: dict[str, PluginRecord] = {}
        self._registry: DeployRegistry | None = None
        self._started = False
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.hooks = PluginHooks(self.pm, kinds)

    # ------------------------------------------------------------------ discovery
    def scan(self) -> EntryPointScan:
        """The cached entry-point scan (empty for a hermetic host)."""
        if self._scan is None:
            self._scan = scan_entry_points(self._search_path) if self._discover else EntryPointScan((), {})
        return self._scan

    def refresh(self) -> None:
        """Forget the scan so the next use re-reads metadata (for tests and installers)."""
        importlib.invalidate_caches()
        self._scan = None
        self._loadable_scan = None

    def discovered(self) -> list[DiscoveredPlugin]:
        return list(self.scan().plugins)

    def _loadable(self) -> EntryPointScan:
        """The scan plus the kernel's built-ins when the scan did not see them; the kernel comes first.

        Loading the kernel first, then plugins by name, makes every outcome deterministic,
        including which of two plugins contributing one name is refused. Cached beside the
        scan (every :meth:`drivers` call reads it) and forgotten with it by :meth:`refresh`.
        """
        if self._loadable_scan is None:
            self._loadable_scan = self._merge_kernel_builtins(self.scan())
        return self._loadable_scan

    def _merge_kernel_builtins(self, scan: EntryPointScan) -> EntryPointScan:
        kernel = canonicalize_name(KERNEL_DISTRIBUTION)
        plugins = list(scan.plugins)
        drivers = {group: list(eps) for group, eps in scan.drivers.items()}
        if self._kernel_builtins and not any(canonicalize_name(p.distribution) == kernel for p in plugins):
            builtins = scan_kernel_distribution()
            plugins.extend(builtins.plugins)
            for group, eps in builtins.drivers.items():
                drivers.setdefault(group, []).extend(eps)
        if not self._kernel_builtins:
            plugins = [p for p in plugins if canonicalize_name(p.distribution) != kernel]
        plugins.sort(key=lambda p: (canonicalize_name(p.distribution) != kernel, canonicalize_name(p.distribution)))
        return EntryPointScan(plugins=tuple(plugins), drivers={g: tuple(eps) for g, eps in drivers.items()})

    # ------------------------------------------------------------------ loading
    @property
    def started(self) -> bool:
        return self._started

    def start(self, *, fail_fast: bool = True) -> None:
        """Load every selected plugin and run its registration hooks, then broadcast ``fv_host_started``. Idempotent.

        A plugin fails when importing it, validating its manifest or running its
        registration hooks raises, or when what it registers is invalid (a card that fails
        validation, a sampler that is not a ``Sampler``, a name another plugin already
        contributes). A failed plugin is unregistered (none of its hooks run) and recorded
        with status ``error``; every other plugin keeps working. A failing plugin that was
        explicitly enabled (or any failing plugin under ``strict``) raises
        :class:`PluginLoadError` when ``fail_fast``; otherwise, and for autoloaded plugins,
        the failure is one :class:`PluginWarning` line.
        """
        if self._started:
            return
        loadable = self._loadable()
        for found in loadable.plugins:
            selection = select(self.config, found.distribution, found.version)
            if not selection.enabled:
                self._records[canonicalize_name(found.distribution)] = PluginRecord(
                    name=found.distribution,
                    version=found.version,
                    entry_point=found.entry_point_text,
                    status=PluginStatus.DISABLED,
                    reason=selection.reason,
                    manifest=self._manifest_or_none(found),
                )
                continue
            self._load(found, selection, fail_fast=fail_fast)
        installed = {canonicalize_name(p.distribution) for p in loadable.plugins}
        enable, _ = self.config.requirements()
        for key, req in enable.items():
            if key not in installed and key not in self._records:
                cause = f"explicitly enabled by {str(req)!r} but not installed (no {PLUGINS_GROUP!r} entry point found)"
                if fail_fast:
                    raise PluginLoadError(req.name, None, None, cause)
                self._records[key] = PluginRecord(req.name, None, None, PluginStatus.ERROR, cause, explicit=True)
        if self._discover:
            # Settings for a plugin that is not installed are read by nothing: most likely a typo.
            for name in self.config.settings:
                if canonicalize_name(name) not in installed:
                    cause = (f"plugins.settings names {name!r}, which is not installed; "
                             f"installed: {', '.join(sorted(p.distribution for p in loadable.plugins))}")
                    if fail_fast:
                        raise PluginConfigError(cause)
                    warnings.warn(f"fv: {cause}", PluginWarning, stacklevel=2)
        self._started = True
        self.hooks.host_started(self)

    def _manifest_or_none(self, found: DiscoveredPlugin) -> PluginManifest | None:
        try:
            return load_manifest(locate_manifest(found.entry_point.value))
        except ManifestError:
            return None

    def _load(self, found: DiscoveredPlugin, selection: Selection, *, fail_fast: bool) -> None:
        key = canonicalize_name(found.distribution)
        manifest: PluginManifest | None = None
        try:
            if selection.problem:
                raise PluginError(selection.problem)
            if canonicalize_name(found.entry_point.name) != key:
                raise PluginError(
                    f"the {PLUGINS_GROUP} entry point is named {found.entry_point.name!r}; "
                    f"it must equal the distribution name {found.distribution!r}"
                )
            manifest = load_manifest(locate_manifest(found.entry_point.value))
            manifest.check_distribution(found.distribution, found.version)
            manifest.check_kernel_api(self.kernel_api)
            try:
                plugin = found.entry_point.load()
            except Exception as exc:  # a plugin's import may raise anything
                raise PluginError(f"importing {found.entry_point.value} raised {one_line(exc)}") from exc
            self.register(plugin, name=found.distribution, manifest=manifest, version=found.version)
        except PluginError as exc:
            cause = " ".join(str(exc).split())
            self._records[key] = PluginRecord(
                name=found.distribution,
                version=found.version,
                entry_point=found.entry_point_text,
                status=PluginStatus.ERROR,
                reason=cause,
                explicit=selection.explicit,
                manifest=manifest,
            )
            if selection.explicit or self.config.strict:
                if fail_fast:
                    raise PluginLoadError(found.distribution, found.version, found.entry_point_text, cause) from exc
            else:
                warnings.warn(
                    f"fv: skipped plugin {found.distribution} {found.version}: {cause}", PluginWarning, stacklevel=3
                )
            return
        record = self._records[key]
        record.entry_point = found.entry_point_text
        record.reason = selection.reason
        record.explicit = selection.explicit

    def register(
        self,
        plugin: object,
        *,
        name: str,
        manifest: PluginManifest | None = None,
        version: str | None = None,
    ) -> None:
        """Register a plugin object (module, class instance) under ``name`` and run its registration hooks.

        Registering the same object under the same name again is a no-op; another
        object under a taken name is an error. Hook implementations are validated
        against the specs: unknown ``fv_*`` hooks and non-wrapper ``fv_wrap_generate``
        implementations are refused. When a registration hook fails or registers
        something invalid, the plugin is unregistered, recorded with status ``error``,
        and the :class:`PluginError` is raised.
        """
        key = canonicalize_name(name)
        existing = self.pm.get_plugin(name)
        if existing is not None:
            if existing is plugin:
                return
            raise PluginError(f"a different plugin object is already registered as {name!r}")
        if manifest is not None and canonicalize_name(manifest.name) != key:
            raise PluginError(f"manifest name {manifest.name!r} does not match plugin name {name!r}")
        try:
            self.pm.register(plugin, name=name)
        except ValueError as exc:
            raise PluginError(f"cannot register plugin {name!r}: {exc}") from exc
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r} has an invalid hook implementation: {exc}") from exc
        try:
            self._validate_hookimpls(plugin, name)
            self.hooks.accept(name, self.hooks.collect(plugin, name))
        except PluginError as exc:
            self.pm.unregister(plugin)
            self.hooks.forget(name)
            self._records[key] = PluginRecord(
                name=name,
                version=version or (manifest.version if manifest else None),
                entry_point=None,
                status=PluginStatus.ERROR,
                reason=" ".join(str(exc).split()),
                manifest=manifest,
            )
            self._registry = None
            raise
        self._records[key] = PluginRecord(
            name=name,
            version=version or (manifest.version if manifest else None),
            entry_point=None,
            status=PluginStatus.ENABLED,
            reason="registered in-process",
            manifest=manifest,
            plugin=plugin,
        )
        self._registry = None

    def unregister(self, name: str) -> None:
        """Remove a registered plugin and its contributions; unknown names are ignored."""
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        self.hooks.forget(name)
        self._records.pop(canonicalize_name(name), None)
        self._registry = None

    def _validate_hookimpls(self, plugin: object, name: str) -> None:
        for caller in self.pm.get_hookcallers(plugin) or []:
            if not caller.has_spec():
                raise PluginError(
                    f"plugin {name!r} implements unknown hook {caller.name!r}; "
                    f"known hooks are defined in fv_kernel.plugins.hookspecs"
                )
            if caller.name == "fv_wrap_generate":
                for impl in caller.get_hookimpls():
                    if impl.plugin is plugin and not (impl.wrapper or impl.hookwrapper):
                        raise PluginError(
                            f"plugin {name!r} implements fv_wrap_generate without wrapper=True; use @hookimpl(wrapper=True)"
                        )

    # ------------------------------------------------------------------ queries
    def records(self) -> list[PluginRecord]:
        """Every known plugin with its status, sorted by name."""
        return sorted(self._records.values(), key=lambda r: canonicalize_name(r.name))

    def record(self, name: str) -> PluginRecord:
        try:
            return self._records[canonicalize_name(name)]
        except KeyError:
            known = ", ".join(r.name for r in self.records()) or "<none>"
            raise PluginError(f"no plugin named {name!r}; known: {known}") from None

    def enabled_names(self) -> list[str]:
        return [r.name for r in self.records() if r.status is PluginStatus.ENABLED]

    def drivers(self, kind: str) -> DriverRegistry:
        """The named drivers of ``kind`` contributed by enabled plugins (starts the host if needed)."""
        spec = kind_spec(kind, self._kinds)
        self.start()
        enabled = {canonicalize_name(n) for n in self.enabled_names()}
        selected: list[EntryPoint] = []
        ignored: dict[str, str] = {}
        for ep in self._loadable().drivers.get(spec.entry_point_group, ()):
            dist = entry_point_distribution(ep)
            if dist is not None and canonicalize_name(dist) in enabled:
                selected.append(ep)
            else:
                ignored[ep.name] = f"its distribution {dist!r} is not an enabled fv plugin"
        return DriverRegistry(kind, selected, kinds=self._kinds, ignored=ignored)

    def registry(self) -> DeployRegistry:
        """The deploy-scope registry: samplers, loops and attention backends of the enabled plugins.

        Built once per set of registered plugins (starts the host if needed); instances
        built for this deployment resolve names through it, never through installed
        entry points of plugins that are not enabled.
        """
        self.start()
        if self._registry is None:
            self._registry = DeployRegistry(
                samplers=self.hooks.samplers().values(),
                loops=self.hooks.loops().values(),
                attention_backends=self.drivers("attention_backends"),
            )
        return self._registry


@functools.cache
def get_host() -> PluginHost:
    """The process-wide host, created and started on first use (never at import).

    It uses the default config plus ``FV_PLUGINS``; deployments that load a deploy
    config build their own :class:`PluginHost` and pass it down.
    """
    host = PluginHost()
    host.start()
    return host
