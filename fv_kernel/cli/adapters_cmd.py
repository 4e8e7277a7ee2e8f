"""``fv adapters``: the LoRA adapters a deployment would register, read and checked as it reads them.

Each file is converted with the card's own adapter converter (its ``adapter_format``), so a
file whose keys map to nothing in that card is an error here, not in the middle of a request.
Nothing is loaded onto a device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from fv_kernel.cli.deploy_options import ConfigOption, fail, load_config, start_host
from fv_kernel.errors import FvError
from fv_kernel.plugins import PluginError

adapters_app = typer.Typer(help="List LoRA adapters as a deployment registers them.", no_args_is_help=True)


def _row(info: Any) -> dict[str, Any]:
    return {
        "name": info.name, "version": info.version, "rank": info.rank, "components": list(info.components),
        "size_bytes": info.size_bytes, "weight_bytes": info.weight_bytes, "assumes_loop": info.assumes_loop,
        "assumes_steps": info.assumes_steps, "source": info.source, "path": info.path,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@adapters_app.command("list")
def list_adapters(
    files: list[Path] = typer.Argument(None, help="Adapter files (.safetensors) to list besides the directories."),
    directory: list[Path] = typer.Option(
        [], "--dir", help="A directory whose *.safetensors files are registered (as the config's adapters.directory); repeatable.",
    ),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="The card whose converter reads the files (default: the installed plugins' default card).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """The adapters of the config's ``adapters.directory``, of each --dir and each FILE: name, content
    version, rank, the components each changes, and a distilled adapter's loop and steps."""
    from fv_kernel.cache.adapters import AdapterSettings
    from fv_kernel.deploy.engine import adapter_registry
    from fv_kernel.deploy.model_resolution import resolve_model

    deploy = load_config(config)
    if deploy.adapters is not None and not deploy.adapters.enabled:
        fail("adapters: the deploy config turns adapters off (adapters.enabled: false)")
    for path in directory:
        if not path.is_dir():
            fail(f"dir: {str(path)!r} is not a directory")
    try:
        host = start_host(deploy)
        card = resolve_model(model, deploy, host).card
        if deploy.adapters is None:
            deploy = deploy.model_copy(update={"adapters": AdapterSettings()})
        registry = adapter_registry(deploy, [card])
        assert registry is not None
        for path in directory:
            registry.scan(path)
        for path in files or []:
            registry.add_file(path)
    except (FvError, PluginError) as exc:
        fail(str(exc.message if isinstance(exc, FvError) else exc))
    rows = [_row(info) for info in registry.list()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo(f"no adapters (card {card.model_id!r}; give files, --dir, or a config with adapters.directory)")
        return
    header = ("NAME", "VERSION", "RANK", "COMPONENTS", "SIZE", "ASSUMES", "SOURCE")
    table = [header] + [
        (r["name"], r["version"], str(r["rank"]), ",".join(r["components"]), _mib(r["size_bytes"]),
         " ".join(filter(None, [r["assumes_loop"] or "", f"{r['assumes_steps']} steps" if r["assumes_steps"] else ""])) or "-",
         r["source"])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        typer.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
