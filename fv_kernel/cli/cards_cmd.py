"""``fv cards``: list, show and validate model cards contributed by plugins.

Validation never loads weights or touches a GPU: a card is a declarative contract.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import ValidationError

from fv_kernel.model.catalog import CardCatalog
from fv_kernel.card.spec import ModelCard
from fv_kernel.errors import FvError
from fv_kernel.model.validate import allowed_samplers
from fv_kernel.cli.deploy_options import ConfigOption, load_config, start_host
from fv_kernel.plugins import PluginError

#: How ``fv cards list`` marks a card with random weights.
_RANDOM_MARK = "(random)"

cards_app = typer.Typer(help="List, show and validate model cards.", no_args_is_help=True)


def _catalog(config: Optional[Path]) -> CardCatalog:
    """The cards of the plugins ``--config`` selects (one ``error:`` line when a required plugin fails)."""
    return CardCatalog(start_host(load_config(config)))


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _describe_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<card>"
        lines.append(f"{where}: {err['msg']}")
    return lines


def _summary(card: ModelCard, plugin: str) -> dict[str, Any]:
    recipe = card.recipe
    recipe_text = recipe.method
    if recipe.assumes_loop:
        recipe_text += f" (assumes loop {recipe.assumes_loop})"
    if recipe.parents:
        recipe_text += f" from {', '.join(recipe.parents)}"
    return {
        "model_id": card.model_id,
        "family": card.family,
        "recipe": recipe_text,
        "tasks": sorted(t.value for t in card.capabilities.tasks),
        "parity": card.parity.level.value,
        "plugin": plugin,
        "random_weights": card.random_weights,
    }


@cards_app.command("list")
def list_cards(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Every card the enabled plugins contribute, with its recipe."""
    try:
        entries = _catalog(config).entries()
    except (FvError, PluginError) as exc:
        _fail(str(exc))
        return
    rows = [_summary(e.card, e.plugin) for e in entries.values()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no cards: install a model plugin (fv checkout: pip install ./plugins/NAME)")
        return
    for line in _table(rows, shutil.get_terminal_size((80, 24)).columns):
        typer.echo(line)


def _table(rows: list[dict[str, Any]], width: int) -> list[str]:
    """``fv cards list`` within ``width`` columns: the tasks wrap in the last column, and a recipe
    beyond its method (the loop it assumes, its parents) gets its own indented line. The family
    is left to ``--json`` and ``fv cards show`` (the plugin column says it for in-repo plugins)."""
    headers = ["model_id", "recipe", "parity", "plugin"]
    # Untrained cards say so where the eye lands first: their output means nothing.
    table = [[r["model_id"] + (f" {_RANDOM_MARK}" if r.get("random_weights") else ""), r["recipe"].split(" ")[0],
              r["parity"], r["plugin"]] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    indent = sum(widths) + 2 * len(widths)
    tasks_width = width - indent
    # Too narrow for the longest task name (and its comma): the tasks go on their own indented lines.
    tasks_inline = tasks_width >= max((len(t) + 1 for r in rows for t in r["tasks"]), default=0)
    header = "  ".join(h.upper().ljust(w) for h, w in zip(headers, widths))
    lines = [header + "  TASKS" if tasks_inline else header.rstrip()]
    for row, summary in zip(table, rows):
        cells = "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
        if tasks_inline:
            wrapped = textwrap.wrap(", ".join(summary["tasks"]), tasks_width, break_on_hyphens=False) or [""]
            lines.append(cells + "  " + wrapped[0])
            lines.extend(" " * indent + more for more in wrapped[1:])
        else:
            lines.append(cells.rstrip())
            lines.extend(textwrap.wrap(f"tasks: {', '.join(summary['tasks'])}", width, initial_indent="    ",
                                       subsequent_indent="      ", break_on_hyphens=False))
        if summary["recipe"] != row[1]:
            lines.extend(textwrap.wrap(f"recipe: {summary['recipe']}", width, initial_indent="    ",
                                       subsequent_indent="      ", break_on_hyphens=False))
    if any(r.get("random_weights") for r in rows):
        lines.extend(textwrap.wrap(f"{_RANDOM_MARK}: seeded random weights, never trained (for tests and plumbing): "
                                   "their videos and text mean nothing", width, break_on_hyphens=False))
    return lines


@cards_app.command("show")
def show_card(
    model_id: str = typer.Argument(..., help="Card id, e.g. wan-tiny."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """The full card as JSON; the samplers ``fv generate --sampler`` accepts for it follow on stderr."""
    try:
        catalog = _catalog(config)
        card = catalog.get(model_id)
        samplers = allowed_samplers(card, catalog.host.registry().sampler_names())
    except (FvError, PluginError) as exc:
        _fail(str(exc))
        return
    typer.echo(card.model_dump_json(indent=2))
    if samplers:
        typer.echo(f"samplers (--sampler): {', '.join(samplers)}", err=True)


@cards_app.command("validate")
def validate_card(
    card: str = typer.Argument(..., help="An installed card id, or a card file (.json / .yaml)."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Validate a card without loading weights; exits non-zero naming each bad field.

    Beyond the card's shape, it must build: every code reference imports (a component's
    builder, the factory, loop classes) and every component config parses through the
    component's ``config_schema`` -- the parser its loader uses.
    """
    from fv_kernel.model.buildcheck import check_card_builds
    from fv_kernel.model.catalog import InvalidCardFile, is_card_file, read_card_file

    catalog = _catalog(config)  # the selected plugins start first: a required one that fails stops here
    path = Path(card)
    if is_card_file(card) or path.is_file():
        try:
            found = read_card_file(path, registry=catalog.host.registry())  # validated and build-checked
        except InvalidCardFile as exc:
            typer.echo(f"invalid card {path}:", err=True)
            for line in exc.problems:
                typer.echo(f"  {line}", err=True)
            raise typer.Exit(1) from None
        except FvError as exc:
            _fail(exc.message)
            return
    else:
        try:
            found = catalog.get(card)
            ModelCard.model_validate(found.model_dump())
        except ValidationError as exc:
            for line in _describe_validation_error(exc):
                typer.echo(f"  {line}", err=True)
            raise typer.Exit(1) from None
        except (FvError, PluginError) as exc:
            _fail(str(exc))
            return
        problems = check_card_builds(found, registry=catalog.host.registry())
        if problems:
            typer.echo(f"invalid card {card}:", err=True)
            for problem in problems:
                typer.echo(f"  {problem}", err=True)
            raise typer.Exit(1)
    unchecked = sorted(cid for cid, comp in found.components.items() if comp.config_schema is None)
    note = f"; not checked (no config_schema): {', '.join(unchecked)}" if unchecked else ""
    typer.echo(f"ok: {found.model_id} ({found.family}, recipe {found.recipe.method}; builds{note})")




@cards_app.command("export")
def export_card(
    card: str = typer.Argument(..., help="An installed card id, or a card file (.json / .yaml)."),
    output: Path = typer.Option(..., "--output", "-o", help="Directory to write (empty or an earlier export)."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Export a card's weights as its family's reference checkpoint directory, kept only if its parity check passes.

    The family plugin writes the directory (for Wan: a diffusers ``WanPipeline`` folder), then
    runs the card's parity check on it; the card serving it goes beside the weights as
    ``fv-card.json`` (``fv generate --model DIR/fv-card.json``).
    """
    from fv_kernel.training.runner import export_model

    catalog = _catalog(config)
    try:
        found = catalog.resolve(card).card
        exported, parity = export_model(found, {}, output, catalog.host)
    except (FvError, PluginError) as exc:
        _fail(exc.message if isinstance(exc, FvError) else str(exc))
        return
    typer.echo(f"exported {exported.model_id} to {output}; parity vs {parity.reference}: "
               f"{parity.metric} {parity.value:.2g} <= {parity.tolerance:.2g}")
