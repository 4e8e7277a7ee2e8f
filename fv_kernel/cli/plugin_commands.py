"""``fv`` sub-commands contributed by plugins, declared in their manifests (``commands:``).

``fv --help`` lists them from installed metadata and each plugin's ``fv-plugin.yaml`` alone:
nothing of the plugin is imported (npe2-style). Running one imports the plugin's entry point
and then the command's target. A command is refused with one line (never a traceback) when
its plugin is disabled by ``FV_PLUGINS``, its manifest is invalid or asks for another kernel
API, or importing it fails. A plugin command may not take a kernel command's name, nor a
name another plugin took first (plugins are read in distribution-name order):
:class:`PluginCommandConflict`, and the command is not offered.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import yaml
from packaging.utils import canonicalize_name

from fv_kernel import API_VERSION
from fv_kernel.plugins.config import KERNEL_DISTRIBUTION, PluginsConfig, select
from fv_kernel.plugins.errors import ManifestError, PluginError, one_line
from fv_kernel.plugins.discovery import DiscoveredPlugin, scan_entry_points
from fv_kernel.plugins.manifest import load_manifest, locate_manifest

__all__ = [
    "PluginCommand",
    "PluginCommandError",
    "PluginCommandConflict",
    "PluginCommands",
    "discover_plugin_commands",
    "load_plugin_command",
]


class PluginCommandError(PluginError):
    """A plugin command cannot run: its plugin is disabled or broken. The message is one line."""


class PluginCommandConflict(PluginCommandError):
    """A plugin command would shadow a kernel command, or another plugin's command of the same name."""


@dataclass(frozen=True)
class PluginCommand:
    """One plugin command as its manifest declares it (nothing imported)."""

    name: str
    plugin: str
    version: str | None
    entry_point: str
    target: str | None
    summary: str
    refusal: str | None = None
    """Why it cannot run, when known without importing (disabled, invalid manifest, kernel API)."""


@dataclass(frozen=True)
class PluginCommands:
    """The plugin commands on offer, and the ones refused for their name."""

    commands: Mapping[str, PluginCommand]
    conflicts: tuple[PluginCommandConflict, ...]


def _raw_command_names(found: DiscoveredPlugin) -> list[str]:
    """A manifest that fails validation still names its commands, so running one can say why it is refused."""
    try:
        data = yaml.safe_load(locate_manifest(found.entry_point.value).read_text(encoding="utf-8"))
    except (ManifestError, OSError, yaml.YAMLError):
        return []
    commands = data.get("commands") if isinstance(data, dict) else None
    return [name for name in commands if isinstance(name, str)] if isinstance(commands, dict) else []


def _declared(found: DiscoveredPlugin, config: PluginsConfig, kernel_api: str) -> list[PluginCommand]:
    selection = select(config, found.distribution, found.version)
    common = {"plugin": found.distribution, "version": found.version, "entry_point": found.entry_point.value}
    try:
        manifest = load_manifest(locate_manifest(found.entry_point.value))
    except ManifestError as exc:
        cause = f"plugin {found.distribution}'s manifest is invalid: {' '.join(str(exc).split())}"
        return [PluginCommand(name, target=None, summary="", refusal=cause, **common) for name in _raw_command_names(found)]
    refusal: str | None = None
    if not selection.enabled:
        refusal = f"plugin {found.distribution} is {selection.reason}; enable it (FV_PLUGINS) to use its commands"
    else:
        try:
            manifest.check_distribution(found.distribution, found.version)
            manifest.check_kernel_api(kernel_api)
        except PluginError as exc:
            refusal = f"plugin {found.distribution} cannot load: {' '.join(str(exc).split())}"
    return [
        PluginCommand(name, target=decl.target, summary=decl.summary, refusal=refusal, **common)
        for name, decl in manifest.commands.items()
    ]


def discover_plugin_commands(
    kernel_commands: Iterable[str],
    *,
    environ: Mapping[str, str] | None = None,
    search_path: Iterable[str] | None = None,
    kernel_api: str = API_VERSION,
) -> PluginCommands:
    """Every installed plugin's declared commands, read from metadata and manifests only.

    ``FV_PLUGINS`` (from ``environ``) decides which plugins are enabled, as for every
    command; a disabled plugin's commands are still listed, so running one can say why
    it is refused. A name taken by the kernel or by an earlier plugin is a conflict.
    """
    env = os.environ if environ is None else environ
    try:
        config = PluginsConfig().with_env(env)
    except PluginError:
        config = PluginsConfig()  # a bad FV_PLUGINS is reported by the command that starts the host
    taken = set(kernel_commands)
    owners: dict[str, str] = {}
    commands: dict[str, PluginCommand] = {}
    conflicts: list[PluginCommandConflict] = []
    scan = scan_entry_points(None if search_path is None else list(search_path))
    for found in scan.plugins:
        if canonicalize_name(found.distribution) == canonicalize_name(KERNEL_DISTRIBUTION):
            continue
        for command in _declared(found, config, kernel_api):
            if command.name in taken:
                conflicts.append(PluginCommandConflict(
                    f"plugin {command.plugin}'s command {command.name!r} is refused: "
                    f"it would shadow the kernel command 'fv {command.name}'"
                ))
            elif command.name in owners:
                conflicts.append(PluginCommandConflict(
                    f"plugin {command.plugin}'s command {command.name!r} is refused: "
                    f"plugin {owners[command.name]} already provides 'fv {command.name}'"
                ))
            else:
                owners[command.name] = command.plugin
                commands[command.name] = command
    return PluginCommands(commands=commands, conflicts=tuple(conflicts))


def load_plugin_command(command: PluginCommand) -> Any:
    """``command``'s target (a ``typer.Typer`` or a function), importing the plugin first.

    Raises :class:`PluginCommandError` (one line) when the command cannot run.
    """
    prefix = f"fv {command.name}"
    if command.refusal is not None:
        raise PluginCommandError(f"{prefix}: {command.refusal}")
    assert command.target is not None  # a valid manifest's command always has one
    module_name, _, attribute = command.target.partition(":")
    try:
        importlib.import_module(command.entry_point.partition(":")[0].strip())
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except Exception as exc:  # a plugin's import may raise anything; the user gets one line
        raise PluginCommandError(
            f"{prefix}: plugin {command.plugin} is broken: importing {command.target} raised {one_line(exc)}"
        ) from exc
    if not callable(target):
        raise PluginCommandError(
            f"{prefix}: plugin {command.plugin}'s target {command.target} is a {type(target).__name__}, "
            "not a typer.Typer or a function"
        )
    return target
