"""``fv plugins``: list installed plugins and check one distribution.

Both commands survive broken plugins: failures become statuses and reasons, never tracebacks.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import typer

from fv_kernel.plugins import PluginConfigError, PluginHost, PluginRecord, PluginsConfig, PluginWarning
from fv_kernel.plugins.check import PluginChecker

plugins_app = typer.Typer(help="Inspect and validate fv plugins.", no_args_is_help=True)

ConfigOption = typer.Option(
    None, "--config", "-c", help="Deploy config YAML; its 'plugins:' section selects plugins.", exists=True, dir_okay=False
)


def _load_config(path: Optional[Path]) -> PluginsConfig:
    if path is None:
        return PluginsConfig()
    try:
        return PluginsConfig.from_yaml(path)
    except PluginConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _record_json(record: PluginRecord) -> dict[str, object]:
    return {
        "name": record.name,
        "version": record.version,
        "status": record.status.value,
        "reason": record.reason,
        "entry_point": record.entry_point,
        "kernel_api": record.manifest.kernel_api if record.manifest else None,
        "contributions": record.contributions,
    }


@plugins_app.command("list")
def list_plugins(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array instead of a table."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Show every discovered plugin: name, version, status (enabled, disabled, error) and contributions."""
    host = PluginHost(_load_config(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginWarning)
        host.start(fail_fast=False)
    for warning in caught:
        typer.echo(f"warning: {warning.message}", err=True)
    records = host.records()
    if as_json:
        typer.echo(json.dumps([_record_json(r) for r in records], indent=2))
        return
    if not records:
        typer.echo("no fv plugins found (entry-point group 'fv.plugins')")
        return
    for record in records:
        typer.echo(f"{record.name} {record.version or '?'}  [{record.status.value}]  {record.reason}")
        for kind, ids in record.contributions.items():
            typer.echo(f"    {kind}: {', '.join(ids)}")


@plugins_app.command("check")
def check_plugin(
    distribution: str = typer.Argument(..., help="Distribution name of the plugin, e.g. fv-wan."),
    side_effects: bool = typer.Option(
        True, "--side-effects/--no-side-effects", help="Also import the plugin in a subprocess to detect CUDA init or weight reads."
    ),
) -> None:
    """Validate one plugin: entry point, manifest, kernel API, import, contributions. Exits 1 on any problem."""
    report = PluginChecker(distribution).run_all(side_effects=side_effects)
    typer.echo(f"{report.distribution} {report.version or '?'}")
    for name, problems in report.results.items():
        typer.echo(f"  {'ok  ' if not problems else 'FAIL'} {name}")
        for problem in problems:
            typer.echo(f"         - {problem}")
    if not report.ok:
        typer.echo(f"{report.distribution}: {len(report.problems())} problem(s)", err=True)
        raise typer.Exit(1)
    typer.echo(f"{report.distribution}: all checks passed")
