"""Behaviour capture on the denoise loops (design §10, ``OutputSpec.capture_behavior``).

A denoise loop that captures keeps one :class:`~fv_kernel.request.artifacts.BehaviorSlice`
per step in its state (so a resumed request keeps its capture) and returns a
:class:`~fv_kernel.request.artifacts.BehaviorRecord` from ``finalize``; the driver streams
each slice as a ``behavior.slice`` event. Capture only reads what the step computed: it
draws no random numbers and changes no tensor the loop goes on with.

Log-probs exist only where the sampler defines a step density: a sampler that implements
:class:`LogProbSampler` (e.g. an SDE sampler a training plugin registers) gets its
``log_prob`` recorded per step; the kernel's ODE samplers define none.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch

from fv_kernel.loop.samplers import Sampler, SamplerState
from fv_kernel.request.artifacts import BehaviorSlice

__all__ = ["LogProbSampler", "capture_slice", "deterministic_flags"]


@runtime_checkable
class LogProbSampler(Protocol):
    """A sampler whose steps have a density: ``log p(next_sample | sample)`` under its step distribution."""

    def log_prob(
        self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor, next_sample: torch.Tensor
    ) -> torch.Tensor:
        """Per-row log-density (shape (B,)) of ``next_sample`` given ``sample`` and the model output, at ``state``'s step."""
        ...


def capture_slice(
    mode: Literal["final", "steps"],
    *,
    sampler: Sampler,
    state: SamplerState,
    sample: torch.Tensor,
    velocity: torch.Tensor,
    next_sample: torch.Tensor,
    noise: torch.Tensor | None,
    expert: str,
    guidance: float,
    branches: tuple[str, ...],
    batch_size: int,
) -> BehaviorSlice:
    """The slice of the step that took ``sample`` to ``next_sample`` from sampler state ``state`` (before the step)."""
    i = state.step_index
    log_prob = None
    if isinstance(sampler, LogProbSampler) and noise is not None:  # an ODE step has no density
        with torch.no_grad():
            log_prob = sampler.log_prob(state, velocity, sample, next_sample).detach().float().reshape(-1)
    keep = mode == "steps"
    return BehaviorSlice(
        step=i, timestep=float(state.timesteps[i]), sigma=float(state.sigmas[i]), sigma_next=float(state.sigmas[i + 1]),
        expert=expert, guidance=float(guidance), branches=tuple(branches), batch_size=int(batch_size),
        stochastic=noise is not None, log_prob=log_prob,
        latents=sample if keep else None, velocity=velocity if keep else None, noise=noise if keep else None,
    )


def deterministic_flags(slices: list[BehaviorSlice]) -> dict[str, bool]:
    """The facts that decide whether replaying a capture is bit-exact."""
    return {
        "torch_deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "ran_alone": all(s.batch_size == 1 for s in slices),
        "stochastic_steps": any(s.stochastic for s in slices),
    }
