"""ComfyUI's ``sampler_name`` × ``scheduler`` pairs fv reproduces, as fv samplers.

A ComfyUI sampler only maps to an fv sampler that computes the same numbers: the schedule
(ComfyUI's ``simple`` / ``normal`` / ``sgm_uniform`` schedulers over the flow model's sigma
table, ``ModelSamplingDiscreteFlow`` with ``ModelSamplingSD3``'s shift) and the update (k-diffusion's
``sample_euler`` on a ``CONST`` model: ``denoised = x - v*sigma``, ``d = (x - denoised)/sigma``,
``x += d*(sigma_next - sigma)``). fv's own ``euler``/``unipc`` use diffusers' schedules, which are
different numbers, so they are not offered as substitutes. Every other ComfyUI sampler
(``uni_pc``, ``dpmpp_2m``, ...) and scheduler (``karras``, ``beta``, ...) is not listed, so a
prompt naming one is refused with ``value_not_in_list`` before anything runs.

Written from ComfyUI's ``comfy/samplers.py``, ``comfy/model_sampling.py`` and
``comfy/k_diffusion/sampling.py``; tests check the sigmas and one update against those
formulas written out independently.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from fv_kernel.api import FlowEulerSampler, SamplerState

__all__ = [
    "SAMPLER_NAMES",
    "SCHEDULER_NAMES",
    "comfy_flow_sigma_table",
    "comfy_sigmas",
    "fv_sampler_name",
    "ComfyEulerSimple",
    "ComfyEulerNormal",
    "ComfyEulerSgmUniform",
    "COMFY_SAMPLERS",
]

#: ComfyUI ``sampler_name`` values fv runs exactly.
SAMPLER_NAMES: tuple[str, ...] = ("euler",)
#: ComfyUI ``scheduler`` values fv runs exactly.
SCHEDULER_NAMES: tuple[str, ...] = ("simple", "normal", "sgm_uniform")

_TIMESTEPS = 1000
_MULTIPLIER = 1000.0


def _flow_sigma(shift: float, timestep: torch.Tensor) -> torch.Tensor:
    """``ModelSamplingDiscreteFlow.sigma``: ComfyUI's ``time_snr_shift`` of ``timestep / multiplier``."""
    t = timestep / _MULTIPLIER
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def comfy_flow_sigma_table(shift: float) -> torch.Tensor:
    """The model's 1000-entry sigma table (float32, ascending), as ``ModelSamplingDiscreteFlow`` builds it."""
    return _flow_sigma(shift, (torch.arange(1, _TIMESTEPS + 1, 1) / _TIMESTEPS) * _MULTIPLIER)


def comfy_sigmas(scheduler: str, shift: float, steps: int) -> torch.Tensor:
    """ComfyUI's ``calculate_sigmas(model_sampling, scheduler, steps)`` for a shifted flow model."""
    table = comfy_flow_sigma_table(shift)
    if scheduler == "simple":
        ss = len(table) / steps
        return torch.FloatTensor([float(table[-(1 + int(x * ss))]) for x in range(steps)] + [0.0])
    if scheduler in ("normal", "sgm_uniform"):
        start = table[-1] * _MULTIPLIER  # timestep(sigma_max)
        end = table[0] * _MULTIPLIER  # timestep(sigma_min)
        append_zero = True
        if scheduler == "sgm_uniform":
            timesteps = torch.linspace(start, end, steps + 1)[:-1]
        else:
            if math.isclose(float(_flow_sigma(shift, end)), 0, abs_tol=0.00001):
                steps += 1
                append_zero = False
            timesteps = torch.linspace(start, end, steps)
        sigs = [float(_flow_sigma(shift, ts)) for ts in timesteps]
        return torch.FloatTensor(sigs + ([0.0] if append_zero else []))
    raise ValueError(f"scheduler {scheduler!r} is not one fv runs; allowed: {', '.join(SCHEDULER_NAMES)}")


class _ComfyEuler(FlowEulerSampler):
    """k-diffusion's Euler (no churn) on ComfyUI's schedule; ``shift`` is ``ModelSamplingSD3``'s."""

    scheduler: ClassVar[str]

    def init_state(self, num_inference_steps: int) -> SamplerState:
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        sigmas = comfy_sigmas(self.scheduler, self.shift, num_inference_steps)
        timesteps = sigmas[:-1] * _MULTIPLIER  # ModelSamplingDiscreteFlow.timestep: what the model sees
        return SamplerState(sampler=self.config_signature(), sigmas=sigmas, timesteps=timesteps)

    def step(
        self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor, *, noise: torch.Tensor | None = None
    ) -> tuple[SamplerState, torch.Tensor]:
        self._check_step_inputs(state, model_output, sample, noise)
        i = state.step_index
        sigma, sigma_next = state.sigmas[i], state.sigmas[i + 1]
        x = sample.to(torch.float32)
        denoised = x - model_output.to(torch.float32) * sigma  # CONST.calculate_denoised
        d = (x - denoised) / sigma  # k-diffusion to_d
        next_sample = (x + d * (sigma_next - sigma)).to(model_output.dtype)
        return state.model_copy(update={"step_index": i + 1}), next_sample


class ComfyEulerSimple(_ComfyEuler):
    """ComfyUI ``euler`` + ``simple``."""

    name: ClassVar[str] = "comfy-euler-simple"
    scheduler: ClassVar[str] = "simple"


class ComfyEulerNormal(_ComfyEuler):
    """ComfyUI ``euler`` + ``normal``."""

    name: ClassVar[str] = "comfy-euler-normal"
    scheduler: ClassVar[str] = "normal"


class ComfyEulerSgmUniform(_ComfyEuler):
    """ComfyUI ``euler`` + ``sgm_uniform``."""

    name: ClassVar[str] = "comfy-euler-sgm_uniform"
    scheduler: ClassVar[str] = "sgm_uniform"


COMFY_SAMPLERS: tuple[type[_ComfyEuler], ...] = (ComfyEulerSimple, ComfyEulerNormal, ComfyEulerSgmUniform)


def fv_sampler_name(sampler_name: str, scheduler: str) -> str:
    """The fv sampler that runs ComfyUI's ``sampler_name`` with ``scheduler``; ValueError when none does."""
    for cls in COMFY_SAMPLERS:
        if sampler_name == "euler" and cls.scheduler == scheduler:
            return cls.name
    raise ValueError(
        f"no fv sampler computes ComfyUI's {sampler_name!r} with scheduler {scheduler!r}; "
        f"allowed: sampler_name {list(SAMPLER_NAMES)}, scheduler {list(SCHEDULER_NAMES)}"
    )
