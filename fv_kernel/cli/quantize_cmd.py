"""``fv quantize``: write a card's fp8 weights once, as a card that loads them as they are (docs/precision.md).

The card's ``precision.fp8_targets`` linears are quantized for ``--precision-path`` (e4m3
weights, a scale per output channel) and written as safetensors in the card's checkpoint
layout under ``--output``, with ``fv-card.json``: ``fv generate --model OUTPUT`` then loads
the fp8 weights without quantizing again. Bad input is one ``error:`` line naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fv_kernel.cli.deploy_options import ConfigOption, fail, load_config, start_host
from fv_kernel.errors import FvError

__all__ = ["quantize"]


def quantize(
    model: str = typer.Option(..., "--model", "-m", help="The card to quantize: a card id, card file or checkpoint directory."),
    precision_path: str = typer.Option(
        ..., "--precision-path", help="fp8_weights or fp8_dynamic: the path the written card serves (it must be one the card lists)."),
    output: Path = typer.Option(..., "--output", "-o", help="A new folder: the fp8 checkpoint and its fv-card.json."),
    model_id: Optional[str] = typer.Option(None, "--model-id", help="The written card's id (default: <card>-<path>)."),
    device: Optional[str] = typer.Option(None, "--device", help="Where to load the card to quantize it (default: the config's entry, else cpu)."),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Write a card's fp8 weights (e4m3, per-channel scales) and a card that loads them without quantizing again."""
    from fv_kernel.deploy.model_resolution import resolve_model
    from fv_kernel.model.quantize import quantize_card

    try:
        deploy = load_config(config)
        host = start_host(deploy)
        choice = resolve_model(model, deploy, host, device=device)
        card = quantize_card(choice.card, choice.options, precision_path, output, model_id=model_id)
    except FvError as exc:
        fail(exc.message)
        return
    quantized = card.recipe.quantized_from
    assert quantized is not None
    typer.echo(f"wrote {card.model_id!r} ({', '.join(quantized.components)} in fp8 for {precision_path}) to {output}\n"
               f"run it: fv generate --model {output} ...")
