"""Flow-GRPO's SDE sampler: the Euler flow ODE turned into an SDE with the same marginals, with log-probs.

With ``dt = sigma' - sigma < 0`` and ``s = a * sqrt(sigma / (1 - sigma))`` (``a`` = ``noise_level``;
at ``sigma = 1`` the denominator uses the schedule's second sigma, as flow_grpo does):

    mu = x (1 + s^2 / (2 sigma) dt) + v (1 + s^2 (1 - sigma) / (2 sigma)) dt
    x' = mu + s sqrt(-dt) eps
    log p(x' | x) = mean over non-batch dims of log N(x'; mu, s^2 (-dt))

With ``a = 0`` (or outside ``sde_window``: Flow-GRPO-Fast) the step is the Euler ODE step,
bit for bit (the same code path as :class:`FlowEulerSampler`). The schedule is Euler's.
The sampler draws no random numbers: the denoise loop passes the request's noise when
``needs_noise`` says so, and the kernel's behaviour capture records ``log_prob``.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar

import torch
from pydantic import Field, model_validator

from fv_kernel.api import FlowEulerSampler, SamplerError, SamplerState

__all__ = ["FlowSDESampler", "sde_mean_std", "gaussian_log_prob"]


def sde_mean_std(
    sample: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor | float, sigma_next: torch.Tensor | float,
    noise_level: float, sigma_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu, std) of the SDE step's Gaussian, in fp32; differentiable in ``velocity``."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32)
    dt = sigma_next - sigma
    denominator = 1 - torch.where(sigma == 1, torch.as_tensor(sigma_max, dtype=torch.float32), sigma)
    std_t = noise_level * torch.sqrt(sigma / denominator)
    x, v = sample.float(), velocity.float()
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_t * torch.sqrt(-dt)


def gaussian_log_prob(next_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(next_sample; mean, std^2) averaged over the non-batch dims: shape (B,)."""
    log_density = -((next_sample.float().detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return log_density.mean(dim=tuple(range(1, log_density.ndim)))


class FlowSDESampler(FlowEulerSampler):
    """Euler's schedule; SDE steps (with a density) where ``noise_level > 0`` and inside ``sde_window``."""

    name: ClassVar[str] = "flow-sde"

    noise_level: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.7
    #: ``[start, stop)`` step indices that are SDE steps (Flow-GRPO-Fast); None: every step.
    sde_window: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=1)]] | None = None

    @model_validator(mode="after")
    def _window(self) -> "FlowSDESampler":
        if self.sde_window is not None and self.sde_window[0] >= self.sde_window[1]:
            raise ValueError(f"sde_window must be [start, stop) with start < stop, got {list(self.sde_window)}")
        return self

    def is_sde_step(self, step_index: int) -> bool:
        if self.noise_level == 0:
            return False
        return self.sde_window is None or self.sde_window[0] <= step_index < self.sde_window[1]

    def needs_noise(self, state: SamplerState) -> bool:
        return self.is_sde_step(state.step_index)

    def step(
        self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor, *, noise: torch.Tensor | None = None
    ) -> tuple[SamplerState, torch.Tensor]:
        if not self.is_sde_step(state.step_index):
            return super().step(state, model_output, sample, noise=noise)  # the Euler step itself
        self._check_step_inputs(state, model_output, sample, noise)
        assert noise is not None
        mean, std = self._mean_std(state, model_output, sample)
        next_sample = (mean + std * noise.float()).to(model_output.dtype)
        return state.model_copy(update={"step_index": state.step_index + 1}), next_sample

    def _mean_std(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = state.step_index
        sigma_max = float(state.sigmas[1])  # flow_grpo's sigma_max; 0 for a 1-step schedule [1, 0]
        return sde_mean_std(sample, model_output, state.sigmas[i], state.sigmas[i + 1], self.noise_level, sigma_max)

    def log_prob(
        self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor, next_sample: torch.Tensor
    ) -> torch.Tensor:
        """log p(next_sample | sample) of this SDE step (the kernel's ``LogProbSampler``); differentiable in ``model_output``."""
        self._check_state(state)
        if not self.is_sde_step(state.step_index):
            raise SamplerError(f"step {state.step_index} is an ODE step: it has no density")
        mean, std = self._mean_std(state, model_output, sample)
        return gaussian_log_prob(next_sample, mean, std)
