"""``fv plugins``: list installed plugins and check one distribution.

Both commands survive broken plugins: an autoloaded plugin that fails becomes a status and
a reason, never a traceback. A plugin the deployment explicitly enabled that fails stops
``fv plugins list`` with one ``error:`` line, as it stops every command that selects plugins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from fv_kernel.cli.deploy_options import ConfigOption, load_config, start_host
from fv_kernel.plugins import KINDS, PluginHost, PluginRecord, PluginStatus
from fv_kernel.plugins.check import PluginChecker
from fv_kernel.plugins.discovery import scan_entry_points

#: How the checker reports a check that did not run because a prerequisite failed.
_SKIPPED = "skipped: "

plugins_app = typer.Typer(help="Inspect and validate fv plugins.", no_args_is_help=True)


def _registered_by_plugin(host: PluginHost) -> dict[str, dict[str, list[str]]]:
    """What each plugin actually registered (its hooks ran at start) and its named drivers: plugin name -> kind -> ids.

    Each kind's drivers and contributions are read once for all plugins; driver ids are
    ``"<distribution>/<name>"``, so the part before the first ``/`` names the plugin.
    """
    out: dict[str, dict[str, list[str]]] = {}
    for kind, spec in KINDS.items():
        if spec.hook is None:
            owned = [(i.partition("/")[0], i) for i in host.drivers(kind).ids()]
        else:
            owned = [(c.plugin, c.id) for c in host.hooks.contributions(kind).values()]
        for plugin, contribution_id in owned:
            out.setdefault(plugin, {}).setdefault(kind, []).append(contribution_id)
    return out


def _commands(record: PluginRecord) -> dict[str, dict[str, str]]:
    """The ``fv`` sub-commands the manifest declares: name -> target and summary (nothing imported)."""
    if record.manifest is None:
        return {}
    return {name: {"target": c.target, "summary": c.summary} for name, c in record.manifest.commands.items()}


def _record_json(record: PluginRecord, registered: dict[str, dict[str, list[str]]]) -> dict[str, object]:
    return {
        "name": record.name,
        "version": record.version,
        "status": record.status.value,
        "reason": record.reason,
        "entry_point": record.entry_point,
        "kernel_api": record.manifest.kernel_api if record.manifest else None,
        "contributions": record.contributions,
        "commands": _commands(record),
        "registered": registered.get(record.name, {}) if record.status is PluginStatus.ENABLED else {},
    }


@plugins_app.command("list")
def list_plugins(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array instead of a table."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Show every discovered plugin: name, version, status (enabled, disabled, error), contributions and commands.

    Contributions and ``fv`` sub-commands are those the manifest declares; ``--json`` adds, for an enabled plugin,
    what it actually registered (``registered``): the ids cards, ``--sampler`` and deploy
    configs may name.
    """
    host = start_host(load_config(config))
    records = host.records()
    if as_json:
        registered = _registered_by_plugin(host)
        typer.echo(json.dumps([_record_json(r, registered) for r in records], indent=2))
        return
    if not records:
        typer.echo("no fv plugins found (entry-point group 'fv.plugins')")
        return
    for record in records:
        typer.echo(f"{record.name} {record.version or '?'}  [{record.status.value}]  {record.reason}")
        for kind, ids in record.contributions.items():
            typer.echo(f"    {kind}: {', '.join(ids)}")
        commands = _commands(record)
        if commands:
            typer.echo(f"    commands: {', '.join(f'fv {name}' for name in commands)}")


@plugins_app.command("check")
def check_plugin(
    distribution: str = typer.Argument(..., help="Distribution name of the plugin, e.g. fv-wan."),
    side_effects: bool = typer.Option(
        True, "--side-effects/--no-side-effects", help="Also import the plugin in a subprocess to detect CUDA init or weight reads."
    ),
) -> None:
    """Validate one plugin: entry point, manifest, kernel API, import, contributions, command targets. Exits 1 on any problem."""
    report = PluginChecker(distribution).run_all(side_effects=side_effects)
    if report.version is None and report.results.get("entry_point"):
        # No such plugin: every other check would be skipped for this one reason.
        installed = sorted({p.distribution for p in scan_entry_points().plugins})
        typer.echo(
            f"error: {report.results['entry_point'][0]}; installed plugins: {', '.join(installed) or 'none'}", err=True
        )
        raise typer.Exit(1)
    typer.echo(f"{report.distribution} {report.version or '?'}")
    failed = 0
    for name, problems in report.results.items():
        if failed and problems and all(p.startswith(_SKIPPED) for p in problems):
            # could not run because an earlier check failed: that failure is already listed
            typer.echo(f"  skip {name} ({problems[0][len(_SKIPPED):].split(':')[0]})")
            continue
        failed += len(problems)
        typer.echo(f"  {'ok  ' if not problems else 'FAIL'} {name}")
        for problem in problems:
            typer.echo(f"         - {problem}")
    if not report.ok:
        typer.echo(f"{report.distribution}: {failed} problem(s)", err=True)
        raise typer.Exit(1)
    typer.echo(f"{report.distribution}: all checks passed")
