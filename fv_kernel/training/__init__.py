"""Training and RL on the serving loops (design §10): the RL-method contract.

The engine never imports this package; RL plugins build on it and on the loops'
behaviour capture. ``fv train`` runs a method from a recipe file
(:mod:`fv_kernel.training.recipe`) through :func:`fv_kernel.training.runner.run_training`:
the method trains the components of a card's instance -- the same model code serving
runs -- and the runner exports the result through the family plugin, checks the card's
parity before keeping it, and writes loss curves.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import torch
from pydantic import BaseModel, ConfigDict

from fv_kernel.card.spec import ParityLevel, RecipeSpec

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.model.instance import ModelInstance
    from fv_kernel.card.spec import ModelCard
    from fv_kernel.training.recipe import TrainingRecipe

__all__ = ["RLMethod", "Reward", "NoOptions", "TrainingRun", "TrainedModel", "ParityResult", "LossLog"]


class NoOptions(BaseModel):
    """The options of a method that takes none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class LossLog:
    """Loss curves per training stage: ``curves[stage][name]`` is a list of ``(step, value)``."""

    curves: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)

    def add(self, stage: str, step: int, losses: Mapping[str, float]) -> None:
        for name, value in losses.items():
            self.curves.setdefault(stage, {}).setdefault(name, []).append((step, float(value)))

    def last(self, stage: str, name: str, window: int = 1) -> float:
        """The mean of the last ``window`` values of one curve."""
        values = [v for _, v in self.curves[stage][name][-window:]]
        return sum(values) / len(values)

    def first(self, stage: str, name: str, window: int = 1) -> float:
        values = [v for _, v in self.curves[stage][name][:window]]
        return sum(values) / len(values)


@dataclass
class TrainingRun:
    """What a method gets from the runner: the recipe, the card's instance on the device, reporting."""

    recipe: "TrainingRecipe"
    options: BaseModel
    card: "ModelCard"
    instance: "ModelInstance"
    device: torch.device
    output: Path
    #: ``report(stage, step, total, losses)``: one training step done (progress, ETA, curves).
    report: Callable[[str, int, int, Mapping[str, float]], None]
    log: LossLog = field(default_factory=LossLog)


@dataclass(frozen=True)
class TrainedModel:
    """A method's result: the trained modules by component id and the recipe that made them."""

    modules: Mapping[str, Any]
    recipe: RecipeSpec
    #: Step counts per stage, recorded in the trained card's ``fv-card.json`` training log.
    steps: Mapping[str, int]
    #: Updates to the exported card's capability defaults (e.g. the guidance the method tuned for).
    defaults: Mapping[str, Any] = field(default_factory=dict)
    #: Loops (``LoopSpec`` by id) the exported card gains, e.g. the few-step loop a distilled
    #: recipe's ``assumes_loop`` names.
    loops: Mapping[str, Any] = field(default_factory=dict)
    #: The card that serves the exported weights, made from the export once its parity check has
    #: passed (the check runs on the export as the family builds it: the weights are what is checked).
    #: A causal student distilled from a bidirectional teacher is served by a causal card (its
    #: chunk-rollout loop and slab pool), not by the teacher's loops. None: the export is the card.
    serve_as: Callable[["ModelCard"], "ModelCard"] | None = None


@dataclass(frozen=True)
class ParityResult:
    """One parity check of a checkpoint against the card's reference."""

    reference: str
    tolerance_name: str
    metric: str
    value: float
    tolerance: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.value <= self.tolerance


class RLMethod(abc.ABC):
    """Base of the plugin contribution kind ``rl_methods``.

    A method declares the consistency rung its rollouts need (design §9.2, C2: per-step
    log-probs for likelihood-based methods, seeded final sample plus prediction-space
    identity for likelihood-free ones) and turns captured rollouts into a loss.
    ``fv train`` constructs it with its recipe options (parsed through ``options_schema``)
    and calls :meth:`train`.
    """

    name: ClassVar[str]
    required_parity: ClassVar[ParityLevel] = ParityLevel.C2
    #: Whether rollouts must capture per-step log-probabilities.
    needs_logprobs: ClassVar[bool] = False
    #: How a recipe's ``options`` parse (a frozen pydantic model; errors name ``options.<field>``).
    options_schema: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options if options is not None else self.options_schema()

    @abc.abstractmethod
    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """The scalar training loss of one batch of captured rollouts and rewards."""

    @abc.abstractmethod
    def train(self, run: TrainingRun) -> TrainedModel:
        """Train ``run.instance``'s components (in place), calling ``run.report`` after each step."""


class Reward(abc.ABC):
    """Base of the plugin contribution kind ``rewards``: scores decoded videos against their prompts.

    Constructed with its options (``options_schema``); :meth:`score` takes a batch of videos
    (B, F, 3, H, W) in [0, 1] and their prompts and returns one float per video (higher is
    better). A prompt the reward cannot read is an ``InvalidRequest`` naming ``prompt``.
    """

    name: ClassVar[str]
    options_schema: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options if options is not None else self.options_schema()

    @abc.abstractmethod
    def score(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Rewards (B,) float32 for ``videos`` (B, F, 3, H, W) in [0, 1] and their ``prompts``."""
