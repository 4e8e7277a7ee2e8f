"""Validate one installed plugin distribution end to end (``fv plugins check``, the conformance kit).

Each ``check_*`` method returns a list of human-readable problems (empty = pass), so a
CLI can print them all and a test can fail with exactly the ones that matter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from typing import Callable, Mapping, Sequence

import pluggy
from packaging.utils import canonicalize_name

from .. import API_VERSION
from .drivers import DriverRegistry, entry_point_distribution
from .errors import PluginError
from .discovery import PLUGINS_GROUP, DiscoveredPlugin, scan_entry_points
from .host import PluginHost
from .kinds import KINDS, KindSpec, check_registered_name, check_satisfies, import_target
from .manifest import PluginManifest, load_manifest, locate_manifest
from .probe import run_probe


class _Skip(Exception):
    """A prerequisite check failed; dependent checks report it instead of running."""


@dataclass
class CheckReport:
    """The outcome of every check for one distribution."""

    distribution: str
    version: str | None
    results: dict[str, list[str]] = field(default_factory=dict)
    """check name → problems (empty = passed)."""

    @property
    def ok(self) -> bool:
        return not any(self.results.values())

    def problems(self) -> list[str]:
        return [f"{name}: {p}" for name, probs in self.results.items() for p in probs]


class PluginChecker:
    """Checks for one distribution; ``search_path`` limits discovery as in :class:`PluginHost`."""

    CHECKS: tuple[str, ...] = (
        "entry_point", "manifest", "import", "register_twice", "contributions", "commands", "import_side_effects",
    )

    def __init__(
        self,
        distribution: str,
        *,
        search_path: Sequence[str] | None = None,
        kinds: Mapping[str, KindSpec] = KINDS,
        kernel_api: str = API_VERSION,
    ) -> None:
        self.distribution = distribution
        self._search_path = search_path
        self._kinds = kinds
        self._kernel_api = kernel_api

    # ------------------------------------------------------------------ prerequisites (cached)
    @functools.cached_property
    def _scan(self) -> tuple[DiscoveredPlugin | None, list[EntryPoint]]:
        scan = scan_entry_points(self._search_path)
        key = canonicalize_name(self.distribution)
        found = next((p for p in scan.plugins if canonicalize_name(p.distribution) == key), None)
        drivers = [
            ep
            for eps in scan.drivers.values()
            for ep in eps
            if canonicalize_name(entry_point_distribution(ep) or "") == key
        ]
        return found, drivers

    def _found(self) -> DiscoveredPlugin:
        found = self._scan[0]
        if found is None:
            raise _Skip(f"no {PLUGINS_GROUP!r} entry point for distribution {self.distribution!r}")
        return found

    @functools.cached_property
    def _manifest_or_error(self) -> PluginManifest | str:
        try:
            found = self._found()
        except _Skip as exc:
            return str(exc)
        try:
            manifest = load_manifest(locate_manifest(found.entry_point.value))
            manifest.check_distribution(found.distribution, found.version)
            manifest.check_kernel_api(self._kernel_api)
        except PluginError as exc:
            return str(exc)
        return manifest

    def _manifest(self) -> PluginManifest:
        manifest = self._manifest_or_error
        if isinstance(manifest, str):
            raise _Skip(f"manifest check failed: {manifest}")
        return manifest

    @functools.cached_property
    def _plugin_or_error(self) -> tuple[object | None, str | None]:
        try:
            found = self._found()
            self._manifest()
        except _Skip as exc:
            return None, str(exc)
        try:
            return found.entry_point.load(), None
        except Exception as exc:  # the plugin's import error, whatever its type
            return None, f"importing {found.entry_point.value} raised {type(exc).__name__}: {exc}"

    def _plugin(self) -> object:
        plugin, error = self._plugin_or_error
        if error is not None:
            raise _Skip(f"import check failed: {error}")
        return plugin

    def _run(self, check: Callable[[], list[str]]) -> list[str]:
        try:
            return check()
        except _Skip as exc:
            return [f"skipped: {exc}"]

    # ------------------------------------------------------------------ checks
    def check_entry_point(self) -> list[str]:
        """The distribution declares ``fv.plugins`` with entry-point name = distribution name."""

        def run() -> list[str]:
            try:
                found = self._found()
            except _Skip as exc:
                return [str(exc)]
            if canonicalize_name(found.entry_point.name) != canonicalize_name(found.distribution):
                return [
                    f"the {PLUGINS_GROUP} entry point is named {found.entry_point.name!r}; "
                    f"it must equal the distribution name {found.distribution!r}"
                ]
            return []

        return self._run(run)

    def check_manifest(self) -> list[str]:
        """``fv-plugin.yaml`` is found without import, validates, matches the distribution and kernel API."""
        return self._run(lambda: [] if isinstance(self._manifest_or_error, PluginManifest) else [self._manifest_or_error])

    def check_import(self) -> list[str]:
        """The ``fv.plugins`` entry point imports, and its hooks validate against the specs."""

        def run() -> list[str]:
            self._manifest()
            try:
                self._bare_host(self._plugin(), self._found().distribution)
            except PluginError as exc:
                return [str(exc)]
            return []

        return self._run(run)

    def check_register_twice(self) -> list[str]:
        """Registering the plugin twice is a no-op: same hooks, same contributions."""

        def run() -> list[str]:
            plugin = self._plugin()
            name = self._found().distribution
            host = PluginHost(discover=False, environ={}, kinds=self._kinds, kernel_builtins=False)
            try:
                host.register(plugin, name=name)
                before = self._registered_ids(host)
                host.register(plugin, name=name)
                after = self._registered_ids(host)
            except PluginError as exc:
                return [f"registering twice failed: {exc}"]
            if len(host.pm.get_plugins()) != 1:
                return [f"registering twice left {len(host.pm.get_plugins())} plugin objects registered"]
            if before != after:
                return [f"contributions changed after registering twice: {sorted(before)} → {sorted(after)}"]
            return []

        return self._run(run)

    def _bare_host(self, plugin: object, name: str) -> PluginHost:
        """A hermetic host with ``plugin`` in its plugin manager and its hooks validated, but
        its registration hooks not yet run: the checks run them and report every problem."""
        host = PluginHost(discover=False, environ={}, kinds=self._kinds, kernel_builtins=False)
        try:
            host.pm.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise PluginError(f"plugin {name!r} has an invalid hook implementation: {exc}") from exc
        host._validate_hookimpls(plugin, name)
        return host

    def _registered_ids(self, host: PluginHost) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for spec in self._kinds.values():
            if spec.hook and getattr(host.pm.hook, spec.hook).get_hookimpls():
                out[spec.kind] = sorted(c.id for c in host.hooks.registered(spec.kind))
        return out

    def check_contributions(self) -> list[str]:
        """Declared contributions exist (hooks or ``fv.<kind>`` entry points) and satisfy their bases."""

        def run() -> list[str]:
            manifest = self._manifest()
            plugin = self._plugin()
            name = self._found().distribution
            problems: list[str] = []
            try:
                host = self._bare_host(plugin, name)
            except PluginError as exc:
                return [str(exc)]
            driver_eps = self._scan[1]
            for spec in self._kinds.values():
                declared = {d.name: d for d in manifest.contributions.get(spec.kind, [])}
                provided: dict[str, object] = {}
                if spec.hook is not None:
                    if getattr(host.pm.hook, spec.hook).get_hookimpls() or declared:
                        try:
                            provided = {c.name: c.obj for c in host.hooks.registered(spec.kind)}
                        except PluginError as exc:
                            problems.append(str(exc))
                            continue
                        for cname, obj in provided.items():
                            try:
                                check_satisfies(spec, obj, what=f"contribution {name}/{cname}")
                                check_registered_name(spec, obj, cname, what=f"contribution {name}/{cname}")
                            except PluginError as exc:
                                problems.append(str(exc))
                    source = f"registered through {spec.hook}"
                else:
                    group_eps = [ep for ep in driver_eps if ep.group == spec.entry_point_group]
                    registry = DriverRegistry(spec.kind, group_eps, kinds=self._kinds)
                    for ep in group_eps:
                        try:
                            provided[ep.name] = registry.load(f"{entry_point_distribution(ep)}/{ep.name}")
                        except PluginError as exc:
                            provided[ep.name] = None
                            problems.append(str(exc))
                    source = f"declared as an entry point in group {spec.entry_point_group}"
                for missing in sorted(set(declared) - set(provided)):
                    problems.append(f"manifest declares {spec.kind} {missing!r}, but it is not {source}")
                for extra in sorted(set(provided) - set(declared)):
                    problems.append(f"{spec.kind} {extra!r} is {source} but not declared in the manifest")
                for decl in declared.values():
                    if decl.target is None:
                        continue
                    try:
                        target = import_target(decl.target)
                        check_satisfies(spec, target, what=f"manifest target {decl.target} of {name}/{decl.name}")
                    except Exception as exc:  # import errors of the target, whatever their type
                        problems.append(f"{spec.kind} {decl.name!r}: target {decl.target}: {type(exc).__name__}: {exc}")
            return problems

        return self._run(run)

    def check_commands(self) -> list[str]:
        """Each declared ``fv`` sub-command's target imports and is a ``typer.Typer`` or a function.

        ``fv --help`` lists commands from the manifest alone, so a broken target would otherwise
        surface only when a user runs the command. The plugin's entry point is imported first,
        as ``fv <name>`` does.
        """

        def run() -> list[str]:
            manifest = self._manifest()
            self._plugin()
            problems: list[str] = []
            for name, decl in manifest.commands.items():
                try:
                    target = import_target(decl.target)
                except Exception as exc:  # import errors of the target, whatever their type
                    problems.append(f"command {name!r}: importing target {decl.target} raised {type(exc).__name__}: {exc}")
                    continue
                if not callable(target):
                    problems.append(
                        f"command {name!r}: target {decl.target} is a {type(target).__name__}, "
                        "not a typer.Typer or a function"
                    )
            return problems

        return self._run(run)

    def check_import_side_effects(self) -> list[str]:
        """In a fresh interpreter, importing and registering the plugin neither initialises CUDA nor reads weights."""

        def run() -> list[str]:
            found = self._found()
            self._manifest()
            result = run_probe(found.distribution, found.entry_point.value, extra_path=list(self._search_path or ()))
            return result.problems()

        return self._run(run)

    def run_all(self, *, side_effects: bool = True) -> CheckReport:
        found = self._scan[0]
        report = CheckReport(self.distribution, found.version if found else None)
        for name in self.CHECKS:
            if name == "import_side_effects" and not side_effects:
                continue
            report.results[name] = getattr(self, f"check_{name}")()
        return report
