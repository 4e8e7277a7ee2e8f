"""Training and RL on the serving loops (design §10): the RL-method contract.

The engine never imports this package; RL plugins build on it and on the loops'
behaviour capture.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from fv_kernel.card.spec import ParityLevel

__all__ = ["RLMethod"]


class RLMethod(abc.ABC):
    """Base of the plugin contribution kind ``rl_methods``.

    A method declares the consistency rung its rollouts need (design §9.2, C2: per-step
    log-probs for likelihood-based methods, seeded final sample plus prediction-space
    identity for likelihood-free ones) and turns captured rollouts into a loss.
    """

    name: ClassVar[str]
    required_parity: ClassVar[ParityLevel] = ParityLevel.C2
    #: Whether rollouts must capture per-step log-probabilities.
    needs_logprobs: ClassVar[bool] = False

    @abc.abstractmethod
    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """The scalar training loss of one batch of captured rollouts and rewards."""
