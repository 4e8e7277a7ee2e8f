"""``fv train`` and ``fv cards export``: run a recipe's method, export through the family plugin, check parity.

The runner is family-agnostic: it builds the recipe's card instance, hands it to the
method found in the plugin host's ``rl_methods`` registry, shows per-stage progress with
an ETA and the latest losses (:class:`fv_kernel.io.progress.StageProgress`: a live tqdm line on
a terminal; off one plain lines, no carriage returns, every tenth of a stage and at its
end), writes loss curves (``losses.json`` and ``losses.png``), and exports.
Export (:func:`export_model`) asks the family plugin to write a checkpoint directory
(``fv_export_checkpoint``) into a staging folder, runs the card's parity check on it
(``fv_check_parity``) and keeps it only when the check passes; the trained card goes
beside the weights as ``fv-card.json``, with its ``RecipeSpec`` filled in by the method.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from fv_kernel.model.catalog import CARD_FILE, CardCatalog, read_card_file_beside
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import build_instance
from fv_kernel.card.spec import ModelCard, RecipeSpec
from fv_kernel.errors import FvError, InvalidRequest
from fv_kernel.io.progress import StageProgress
from fv_kernel.training import LossLog, ParityResult, RLMethod, TrainingRun
from fv_kernel.training.recipe import RecipeError, TrainingRecipe, load_recipe, parse_options

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.plugins.host import PluginHost

__all__ = [
    "CARD_FILE", "ExportError", "TrainingOutcome", "resolve_method", "pick_device", "run_training", "export_model",
    "write_loss_curves", "read_card_file_beside",
]

_TRAIN_EXTRAS = ("tqdm", "matplotlib")
#: Off a terminal (a log file, a pipe), a plain progress line each time a stage finishes another tenth.
PROGRESS_LINES_PER_STAGE = 10


class ExportError(FvError):
    """An export that was refused: no plugin exports the family, or the parity check failed."""

    error_type = "export_refused"


@dataclass(frozen=True)
class TrainingOutcome:
    card: ModelCard
    checkpoint: Path
    parity: ParityResult
    log: LossLog
    seconds: float


def resolve_method(host: "PluginHost", name: str) -> type[RLMethod]:
    """The registered ``rl_methods`` class named ``name`` (short or ``plugin/name``); else a RecipeError listing them."""
    from fv_kernel.plugins.hooks import find_contribution
    from fv_kernel.plugins.errors import PluginError

    host.start()
    found = host.hooks.rl_methods()
    try:
        return find_contribution(found, "rl_methods", name).obj  # type: ignore[return-value]
    except PluginError:
        allowed = sorted({*found, *(c.name for c in found.values())}) or ["<none: install a plugin with rl_methods>"]
        raise RecipeError("method", f"no registered training method {name!r}", allowed=allowed) from None


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise RecipeError("device", f"{spec!r} is not a torch device", allowed=["auto", "cpu", "cuda", "cuda:N"]) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device", f"{spec!r} was asked for but CUDA is not available", allowed=["auto", "cpu"])
    return device


def write_loss_curves(log: LossLog, output: Path) -> tuple[Path, Path]:
    """``losses.json`` (every point) and ``losses.png`` (one panel per stage, log-scale y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output.mkdir(parents=True, exist_ok=True)
    json_path, png_path = output / "losses.json", output / "losses.png"
    json_path.write_text(json.dumps({s: {n: [[i, v] for i, v in pts] for n, pts in c.items()} for s, c in log.curves.items()}, indent=1))
    stages = list(log.curves)
    fig, axes = plt.subplots(1, max(1, len(stages)), figsize=(5 * max(1, len(stages)), 3.5), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        for name, points in log.curves[stage].items():
            positive = [(i, v) for i, v in points if v > 0 and math.isfinite(v)]
            if positive:
                ax.plot([i for i, _ in positive], [v for _, v in positive], label=name, linewidth=1)
        ax.set_yscale("log")
        ax.set_title(stage)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return json_path, png_path


def _require_extras() -> None:
    missing = [name for name in _TRAIN_EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        raise InvalidRequest("recipe", f"fv train needs {', '.join(missing)} (pip install {' '.join(missing)})")


def run_training(
    recipe: TrainingRecipe | Path, output: Path, host: "PluginHost", *, progress: bool = True
) -> TrainingOutcome:
    """Train ``recipe``'s card with its method, write curves under ``output``, export to ``output/checkpoint``.

    ``progress``: per-stage progress on stderr (off a terminal: plain lines, no ``\\r``).
    """
    if isinstance(recipe, Path):
        recipe = load_recipe(recipe)
    method_cls = resolve_method(host, recipe.method)
    options = parse_options(recipe, method_cls.options_schema)
    # A card id, a card file or an earlier export's folder (to continue training from its weights).
    resolved = CardCatalog(host).resolve(recipe.card)
    card = resolved.card
    _require_extras()  # after the recipe's own errors, which name its fields
    device = pick_device(recipe.device)
    torch.manual_seed(recipe.seed)
    instance = build_instance(
        card, InstanceOptions(device=str(device), precision="fp32", registry=host.registry(), source=resolved.source)
    )
    output.mkdir(parents=True, exist_ok=True)
    bar = StageProgress(progress, plain_parts=PROGRESS_LINES_PER_STAGE)
    log = LossLog()

    def report(stage: str, step: int, total: int, losses: Mapping[str, float]) -> None:
        log.add(stage, step, losses)
        bar.update(stage, step, total, losses)

    run = TrainingRun(recipe=recipe, options=options, card=card, instance=instance, device=device, output=output,
                      report=report, log=log)
    start = time.perf_counter()
    try:
        trained = method_cls(options).train(run)
    finally:
        bar.close()
        if log.curves:
            write_loss_curves(log, output)
    seconds = time.perf_counter() - start
    summary = recipe.summary or card.summary
    exported, parity = export_model(
        card, trained.modules, output / "checkpoint", host, model_id=recipe.output_model_id, recipe=trained.recipe,
        summary=summary, defaults=trained.defaults, loops=trained.loops, serve_as=trained.serve_as,
    )
    (output / "training.json").write_text(json.dumps({
        "recipe": recipe.model_dump(mode="json"), "steps": dict(trained.steps), "seconds": round(seconds, 1),
        "device": str(device) if device.type != "cuda" else f"cuda ({torch.cuda.get_device_name(device)})",
        "final_losses": {s: {n: log.last(s, n, 20) for n in c} for s, c in log.curves.items()},
        "parity": {"reference": parity.reference, parity.metric: parity.value, "tolerance": parity.tolerance},
    }, indent=1))  # fmt: skip
    return TrainingOutcome(card=exported, checkpoint=output / "checkpoint", parity=parity, log=log, seconds=seconds)


def export_model(
    card: ModelCard,
    modules: Mapping[str, Any],
    directory: Path,
    host: "PluginHost",
    *,
    model_id: str | None = None,
    recipe: RecipeSpec | None = None,
    summary: str | None = None,
    defaults: Mapping[str, Any] | None = None,
    loops: Mapping[str, Any] | None = None,
    serve_as: Callable[[ModelCard], ModelCard] | None = None,
) -> tuple[ModelCard, ParityResult]:
    """Export ``card`` (with ``modules`` replacing its components) to ``directory`` if its parity check passes.

    ``loops`` (``LoopSpec`` by id) are added to the exported card (e.g. a distilled few-step
    loop its recipe's ``assumes_loop`` names). The family's parity check then runs on the
    card's own loops with that assumption lifted: the reference (e.g. diffusers) runs the base
    loop, and the weights are what is checked; the added loop's sampler has its own tests.
    ``serve_as`` (:attr:`TrainedModel.serve_as`) then makes the card written beside the weights
    from the checked one (a causal card for a causal student); a card it returns that does not
    validate is an :class:`ExportError`.

    The weights go to ``<directory>.unchecked`` first; the family's parity check runs there;
    on success the folder becomes ``directory`` with ``fv-card.json`` in it. On failure
    :class:`ExportError` names the measured value and the tolerance, and nothing is written
    at ``directory`` (the staging folder stays for inspection).
    """
    directory = directory.resolve()
    if directory.exists() and any(directory.iterdir()) and not (directory / CARD_FILE).is_file():
        raise ExportError(f"{directory} exists and is not an earlier export (no {CARD_FILE}); choose an empty path", param="output")
    staging = directory.with_name(directory.name + ".unchecked")
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    exported = host.hooks.export_checkpoint(card, dict(modules), staging)
    if exported is None:
        raise ExportError(f"no enabled plugin exports cards of family {card.family!r}", param="model")
    if not isinstance(exported, ModelCard):
        raise ExportError(f"fv_export_checkpoint returned {type(exported).__name__}, expected a ModelCard", param="model")
    update: dict[str, Any] = {}
    if model_id is not None:
        update["model_id"] = model_id
    if recipe is not None:
        update["recipe"] = recipe
    if summary is not None:
        update["summary"] = summary
    if defaults:
        caps = exported.capabilities
        assert caps.defaults is not None
        update["capabilities"] = caps.model_copy(update={"defaults": caps.defaults.model_copy(update=dict(defaults))})
    if loops:
        update["loops"] = {**exported.loops, **dict(loops)}
    staged_card = ModelCard.model_validate({**exported.model_dump(), **{k: v for k, v in update.items()}})
    checked = staged_card
    if loops and staged_card.recipe.assumes_loop in loops:
        checked = staged_card.model_copy(update={"recipe": staged_card.recipe.model_copy(update={"assumes_loop": None})})
    parity = host.hooks.check_parity(checked, staging)
    if parity is None:
        raise ExportError(f"no enabled plugin checks parity for family {card.family!r}; refusing to export unchecked", param="model")
    if not parity.passed:
        raise ExportError(
            f"parity check failed: {parity.metric} {parity.value:.3g} > {parity.tolerance:.3g} ({parity.tolerance_name} vs "
            f"{parity.reference}{'; ' + parity.detail if parity.detail else ''}); the unchecked export is at {staging}",
            param="model",
        )
    served = staged_card
    if serve_as is not None:
        try:
            served = ModelCard.model_validate(serve_as(staged_card).model_dump())
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise ExportError(f"the method's serve_as card for {staged_card.model_id!r} is invalid: {exc}; "
                              f"the checked export is at {staging}", param="model") from exc
    final = served.model_copy(update={"checkpoint": served.checkpoint.model_copy(update={"source": str(directory)})})
    final = ModelCard.model_validate(final.model_dump())
    (staging / CARD_FILE).write_text(final.model_dump_json(indent=2))
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    return final, parity


