"""``fv train``: run a training recipe (a registered ``rl_methods`` method on a card) and export the result.

Progress per stage with an ETA on stderr; ``losses.json``, ``losses.png`` and
``training.json`` under ``--output``; the trained checkpoint in ``--output/checkpoint``
(kept only when the card's parity check passes) with its card in ``fv-card.json``.
Bad input is one ``error:`` line naming the field, and a non-zero exit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fv_kernel.cli.deploy_options import ConfigOption, load_config, start_host
from fv_kernel.errors import FvError

__all__ = ["train"]


def train(
    recipe: Path = typer.Option(..., "--recipe", "-r", help="Recipe file (.yaml/.json): method, card, output_model_id, seed, device, options."),
    output: Path = typer.Option(..., "--output", "-o", help="Run directory: loss curves, training.json, and checkpoint/ (the exported card)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Train a card with a registered method and export it as a checkpoint fv (and its reference) load."""
    from fv_kernel.training.runner import run_training

    host = start_host(load_config(config))
    try:
        outcome = run_training(recipe, output, host, progress=not quiet)
    except FvError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2)
    parity = outcome.parity
    typer.echo(
        f"trained {outcome.card.model_id!r} in {outcome.seconds:.0f} s; parity vs {parity.reference}: "
        f"{parity.metric} {parity.value:.2g} <= {parity.tolerance:.2g}\n"
        f"checkpoint: {outcome.checkpoint}  (fv generate --model {outcome.checkpoint / 'fv-card.json'} ...)\n"
        f"loss curves: {output / 'losses.png'}, {output / 'losses.json'}"
    )
