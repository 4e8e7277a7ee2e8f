"""Flow-matching samplers: pure, per-request policies over a typed state.

A sampler object is immutable configuration (a frozen pydantic model). Everything
that changes during a request — the sigma table, the step counter, multistep
history — lives in a :class:`SamplerState`, which ``step`` never mutates: it
returns a new state. So one sampler instance serves any number of concurrent
requests, and a state saved mid-trajectory (``to_bytes``) resumes bit-identically.

Conventions (those of diffusers' flow schedulers, which the tests check step by step):

* ``x_t = sigma * noise + (1 - sigma) * x0``; the model predicts the velocity
  ``v = noise - x0``, so ``x0 = x_t - sigma * v``.
* ``state.sigmas`` has ``num_steps + 1`` entries and ends at 0; ``state.timesteps``
  has ``num_steps`` entries, the model's timestep in [0, num_train_timesteps].
* Samplers never draw random numbers. When ``needs_noise(state)`` is true the caller
  draws the noise from the request's RNG and passes it to ``step``.
"""

from __future__ import annotations

import abc
import contextlib
import json
import math
from contextvars import ContextVar
from types import MappingProxyType
from typing import Annotated, ClassVar, Iterator, Literal, Mapping

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fv_kernel import DISTRIBUTION
from fv_kernel.card.recipe import sampler_short_name
from fv_kernel.card.spec import SamplerBinding
from fv_kernel.state import TensorState

__all__ = [
    "SamplerError",
    "SamplerState",
    "UniPCState",
    "Sampler",
    "FlowEulerSampler",
    "FlowUniPCSampler",
    "DMDSampler",
    "builtin_samplers",
    "registered_samplers",
    "use_samplers",
    "sampler_class",
    "bound_sampler",
    "sampler_from_state",
    "shift_sigmas",
    "add_noise",
]


class SamplerError(ValueError):
    """A sampler was driven with bad input (wrong state, shapes, step count or noise)."""


# --------------------------------------------------------------------------- helpers


def shift_sigmas(sigmas: np.ndarray | torch.Tensor, shift: float) -> np.ndarray | torch.Tensor:
    """The static flow time shift ``s*sigma / (1 + (s-1)*sigma)`` (Wan/SD3 "flow_shift").

    Evaluated in the dtype of ``sigmas``; the schedule builders below rely on that to
    reproduce diffusers' float64-then-float32 rounding exactly.
    """
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """Forward process ``sigma * noise + (1 - sigma) * x0``.

    ``sigma`` is a float, a 0-d tensor, or a 1-d tensor with one sigma per sample
    (leading dimension of ``x0``).
    """
    if noise.shape != x0.shape:
        raise SamplerError(f"noise shape {tuple(noise.shape)} != x0 shape {tuple(x0.shape)}")
    if isinstance(sigma, torch.Tensor) and sigma.ndim == 1:
        if sigma.shape[0] != x0.shape[0]:
            raise SamplerError(f"per-sample sigma has {sigma.shape[0]} entries for batch {x0.shape[0]}")
        sigma = sigma.reshape((-1,) + (1,) * (x0.ndim - 1))
    return sigma * noise + (1.0 - sigma) * x0


def _check_num_steps(num_inference_steps: int) -> int:
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 1:
        raise SamplerError(f"num_inference_steps must be an int >= 1, got {num_inference_steps!r}")
    return num_inference_steps


# --------------------------------------------------------------------------- state


class SamplerState(TensorState):
    """Per-request sampler state. ``sampler`` is the owning sampler's ``config_signature()``:
    a state can only be advanced by a sampler with the same configuration."""

    sampler: str
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    step_index: int = 0
    #: Steps at which the caller changes the denoiser (a two-expert card's switch). A sampler that
    #: models each stage as its own sampler call restarts its history there; the others ignore it.
    stage_starts: tuple[int, ...] = ()

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])


class UniPCState(SamplerState):
    """UniPC's multistep memory.

    ``model_outputs``: the last ``<= solver_order`` x0 predictions, oldest first.
    ``last_sample``: the sample the previous predictor started from (the corrector's input).
    ``lower_order_nums``: warm-up counter (capped at ``solver_order``).
    ``this_order``: the order the previous predictor used (the next corrector reuses it).
    """

    model_outputs: list[torch.Tensor] = Field(default_factory=list)
    last_sample: torch.Tensor | None = None
    lower_order_nums: int = 0
    this_order: int = 0


# --------------------------------------------------------------------------- base


class Sampler(BaseModel, abc.ABC):
    """Base class of the ``samplers`` plugin contribution kind.

    Subclasses are frozen pydantic configs (unknown fields rejected) and implement the
    step math. ``state_type`` names the :class:`SamplerState` subclass their states use,
    which is what ``SamplerState.from_bytes`` must be called on.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: ClassVar[str]
    state_type: ClassVar[type[SamplerState]] = SamplerState

    num_train_timesteps: Annotated[int, Field(ge=1)] = 1000

    # -- schedule ---------------------------------------------------------------

    @abc.abstractmethod
    def init_state(self, num_inference_steps: int) -> SamplerState:
        """A fresh state at step 0 for a trajectory of ``num_inference_steps`` steps."""

    @abc.abstractmethod
    def step(
        self,
        state: SamplerState,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        *,
        noise: torch.Tensor | None = None,
    ) -> tuple[SamplerState, torch.Tensor]:
        """Advance one step: ``(new_state, next_sample)``. The input state is left untouched."""

    def timestep(self, state: SamplerState) -> torch.Tensor:
        """The model's timestep for the current step (0-d tensor, dtype as in diffusers)."""
        self._check_state(state)
        return state.timesteps[state.step_index]

    def sigma(self, state: SamplerState) -> float:
        self._check_state(state)
        return float(state.sigmas[state.step_index])

    def is_done(self, state: SamplerState) -> bool:
        return state.step_index >= state.num_steps

    def needs_noise(self, state: SamplerState) -> bool:
        """True when the next ``step`` needs fresh noise (drawn by the caller)."""
        return False

    def resume_check_steps(self) -> int:
        """The fewest steps of a trajectory in which every value this sampler's state carries
        from one step to the next is read after some step boundary.

        A resume check that checkpoints every step boundary of a trajectory this long (the
        conformance kit's ``ResumeConformance`` raises shorter requests to it) resumes at least
        once where each part of the state matters; on a shorter one a state that loses part of
        its history can still resume bit-identically. A sampler that carries history across
        steps (multistep solvers) overrides this; a memoryless one carries only its step index,
        which matters from 2 steps on.
        """
        return 2

    def config_signature(self) -> str:
        """A stable string of this configuration (for cache keys and recipe checks)."""
        fields = self.model_dump(mode="json")
        return f"{self.name}:{json.dumps(fields, sort_keys=True, separators=(',', ':'))}"

    # -- shared checks ----------------------------------------------------------

    def _check_state(self, state: SamplerState) -> None:
        if not isinstance(state, self.state_type):
            raise SamplerError(
                f"{type(self).__name__} needs a {self.state_type.__name__}, got {type(state).__name__}"
            )
        signature = self.config_signature()
        if state.sampler != signature:
            raise SamplerError(f"state belongs to sampler {state.sampler!r}, not {signature!r}")
        if not 0 <= state.step_index < state.num_steps:
            raise SamplerError(
                f"step_index {state.step_index} is outside [0, {state.num_steps}); the trajectory is done"
            )

    def _check_step_inputs(
        self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor, noise: torch.Tensor | None
    ) -> None:
        self._check_state(state)
        if model_output.shape != sample.shape:
            raise SamplerError(
                f"model_output shape {tuple(model_output.shape)} != sample shape {tuple(sample.shape)}"
            )
        wants_noise = self.needs_noise(state)
        if wants_noise and noise is None:
            raise SamplerError(f"{self.name} step {state.step_index} needs fresh noise; pass noise=")
        if not wants_noise and noise is not None:
            # Strict on purpose: an unexpected draw would silently shift the request's RNG stream.
            raise SamplerError(f"{self.name} step {state.step_index} takes no noise (needs_noise is False)")
        if noise is not None and noise.shape != sample.shape:
            raise SamplerError(f"noise shape {tuple(noise.shape)} != sample shape {tuple(sample.shape)}")


class _ShiftedFlowSampler(Sampler):
    shift: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0


# --------------------------------------------------------------------------- Euler


class FlowEulerSampler(_ShiftedFlowSampler):
    """First-order Euler on the flow ODE; equals diffusers ``FlowMatchEulerDiscreteScheduler(shift=...)``
    (static shift, no dynamic shifting/Karras/terminal stretch).

    Schedule detail reproduced from diffusers: the inference grid is a linspace from the
    *shifted* training sigma_max to the *shifted* training sigma_min (= shift(1/T)), and is
    then shifted again. So the last non-zero sigma is shift(shift(1/T)), not shift(1/T).
    """

    name: ClassVar[str] = "euler"

    def init_state(self, num_inference_steps: int) -> SamplerState:
        n = _check_num_steps(num_inference_steps)
        T = self.num_train_timesteps
        # Training-table endpoints, rounded through float32 exactly as the scheduler's table is.
        train_ends = torch.tensor([float(T), 1.0], dtype=torch.float32) / T
        train_ends = shift_sigmas(train_ends, self.shift)
        sigma_max, sigma_min = train_ends[0].item(), train_ends[1].item()
        grid = np.linspace(sigma_max * T, sigma_min * T, n) / T  # float64, like diffusers
        sigmas = torch.from_numpy(shift_sigmas(grid, self.shift)).to(torch.float32)
        timesteps = sigmas * T
        sigmas = torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])
        return SamplerState(sampler=self.config_signature(), sigmas=sigmas, timesteps=timesteps)

    def step(
        self,
        state: SamplerState,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        *,
        noise: torch.Tensor | None = None,
    ) -> tuple[SamplerState, torch.Tensor]:
        self._check_step_inputs(state, model_output, sample, noise)
        i = state.step_index
        dt = state.sigmas[i + 1] - state.sigmas[i]
        # Accumulate in fp32 (as diffusers does), return in the model's dtype.
        next_sample = (sample.to(torch.float32) + dt * model_output).to(model_output.dtype)
        return state.model_copy(update={"step_index": i + 1}), next_sample


# --------------------------------------------------------------------------- UniPC


def _flow_lambda(sigma: torch.Tensor) -> torch.Tensor:
    """Half log-SNR of the flow path: log(alpha) - log(sigma) with alpha = 1 - sigma."""
    return torch.log(1 - sigma) - torch.log(sigma)


class FlowUniPCSampler(_ShiftedFlowSampler):
    """UniPC (UniP predictor + UniC corrector, B(h) variants) in x0-prediction form on flow sigmas.

    Equals diffusers ``UniPCMultistepScheduler(prediction_type="flow_prediction",
    use_flow_sigmas=True, flow_shift=shift, solver_order=..., solver_type=...,
    disable_corrector=...)`` with its defaults otherwise (predict_x0, lower_order_final,
    timestep_spacing "linspace", final_sigmas_type "zero") — Wan's released scheduler
    (flow_shift 3.0 at 480p, 5.0 at 720p).

    ``lower_order_final`` is not optional here: the final sigma is 0, so its log-SNR is
    infinite and any order > 1 on the last step divides by it (diffusers then returns NaN
    or fails a singular solve). The last step is therefore always first order. It then
    returns the last x0 prediction exactly; diffusers' ``bh1`` variant instead evaluates
    ``B_h * 0`` with ``B_h = -inf`` there and returns NaN, the one known divergence.

    Schedule: sigmas = shift(linspace(1, 1/T, n+1)[:-1]) in float64, the first nudged to
    1 - 1e-6 so log(sigma) stays finite; the model timestep is int(sigma*T) (int64, truncated).
    """

    name: ClassVar[str] = "unipc"
    state_type: ClassVar[type[SamplerState]] = UniPCState

    solver_order: Annotated[int, Field(ge=1, le=3)] = 2
    solver_type: Literal["bh1", "bh2"] = "bh2"
    disable_corrector: tuple[Annotated[int, Field(ge=0)], ...] = ()

    def init_state(self, num_inference_steps: int) -> UniPCState:
        n = _check_num_steps(num_inference_steps)
        T = self.num_train_timesteps
        sigmas = shift_sigmas(np.linspace(1.0, 1.0 / T, n + 1)[:-1], self.shift)
        if abs(sigmas[0] - 1.0) < 1e-6:
            sigmas[0] -= 1e-6
        timesteps = torch.from_numpy(sigmas * T).to(torch.int64)
        sigmas = torch.from_numpy(np.append(sigmas, 0.0).astype(np.float32))
        return UniPCState(sampler=self.config_signature(), sigmas=sigmas, timesteps=timesteps)

    def resume_check_steps(self) -> int:
        """``solver_order + 2`` (4 at the default order 2).

        Step ``i`` reads the predictor history (``model_outputs``, ``lower_order_nums``) and, in
        its corrector, ``last_sample`` and ``this_order`` from step ``i - 1``. Warm-up reaches the
        full order only at step ``solver_order - 1`` (predictor) and ``solver_order`` (the corrector
        of the step after it); the last step is first order and returns its x0 prediction, which
        the corrector does not change, so it reads none of it. The corrector's full-order step
        therefore needs ``solver_order + 2`` steps (for order 2: the checkpoint at step 2 of 4).
        """
        return self.solver_order + 2

    def step(
        self,
        state: SamplerState,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        *,
        noise: torch.Tensor | None = None,
    ) -> tuple[UniPCState, torch.Tensor]:
        self._check_step_inputs(state, model_output, sample, noise)
        assert isinstance(state, UniPCState)
        i = state.step_index
        sigmas = state.sigmas
        x0_pred = sample - sigmas[i] * model_output

        if i > 0 and (i - 1) not in self.disable_corrector and state.last_sample is not None:
            sample = self._correct(state, x0_pred, sample)

        history = [*state.model_outputs, x0_pred][-self.solver_order :]
        # Fewer history terms near the end (lower_order_final) and during warm-up.
        order = min(self.solver_order, state.num_steps - i, state.lower_order_nums + 1)

        next_sample = self._predict(sigmas, i, history, sample, order)
        new_state = state.model_copy(
            update={
                "step_index": i + 1,
                "model_outputs": history,
                "last_sample": sample,
                "lower_order_nums": min(state.lower_order_nums + 1, self.solver_order),
                "this_order": order,
            }
        )
        return new_state, next_sample

    # The B(h) coefficient system shared by predictor and corrector. ``lambda_others`` are
    # the lambdas of the older history points (most recent first).
    def _coefficients(
        self, lambda_t: torch.Tensor, lambda_s0: torch.Tensor, lambda_others: list[torch.Tensor], order: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        h = lambda_t - lambda_s0
        rks = [(lam - lambda_s0) / h for lam in lambda_others]
        rks_all = torch.stack([*rks, torch.ones((), dtype=h.dtype)])
        hh = -h  # x0-prediction form
        h_phi_1 = torch.expm1(hh)
        B_h = hh if self.solver_type == "bh1" else torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        factorial = 1
        R_rows, b = [], []
        for k in range(1, order + 1):
            R_rows.append(torch.pow(rks_all, k - 1))
            b.append(h_phi_k * factorial / B_h)
            factorial *= k + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        return torch.stack(R_rows), torch.stack(b), h_phi_1, B_h, rks

    @staticmethod
    def _weighted_sum(rhos: torch.Tensor, terms: list[torch.Tensor]) -> torch.Tensor:
        # Weighted sum over the history axis; einsum keeps it one fused contraction.
        return torch.einsum("k,k...->...", rhos, torch.stack(terms))

    def _predict(
        self, sigmas: torch.Tensor, i: int, history: list[torch.Tensor], x: torch.Tensor, order: int
    ) -> torch.Tensor:
        sigma_t, sigma_s0 = sigmas[i + 1], sigmas[i]
        alpha_t = 1 - sigma_t
        m0 = history[-1]
        lambda_others = [_flow_lambda(sigmas[i - k]) for k in range(1, order)]
        lambda_s0 = _flow_lambda(sigma_s0)
        R, b, h_phi_1, B_h, rks = self._coefficients(_flow_lambda(sigma_t), lambda_s0, lambda_others, order)
        x_next = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
        if order > 1:
            D1s = [(history[-(k + 1)] - m0) / rks[k - 1] for k in range(1, order)]
            if order == 2:
                rhos_p = torch.full((1,), 0.5, dtype=x.dtype)
            else:
                rhos_p = torch.linalg.solve(R[:-1, :-1], b[:-1]).to(x.dtype)
            x_next = x_next - alpha_t * B_h * self._weighted_sum(rhos_p, D1s)
        return x_next.to(x.dtype)

    def _correct(self, state: UniPCState, x0_pred: torch.Tensor, this_sample: torch.Tensor) -> torch.Tensor:
        sigmas, i, order = state.sigmas, state.step_index, state.this_order
        history = state.model_outputs
        x = state.last_sample
        assert x is not None
        sigma_t, sigma_s0 = sigmas[i], sigmas[i - 1]
        alpha_t = 1 - sigma_t
        m0 = history[-1]
        lambda_others = [_flow_lambda(sigmas[i - 1 - k]) for k in range(1, order)]
        R, b, h_phi_1, B_h, rks = self._coefficients(
            _flow_lambda(sigma_t), _flow_lambda(sigma_s0), lambda_others, order
        )
        if order == 1:
            rhos_c = torch.full((1,), 0.5, dtype=x.dtype)
        else:
            rhos_c = torch.linalg.solve(R, b).to(x.dtype)
        correction = rhos_c[-1] * (x0_pred - m0)
        if order > 1:
            D1s = [(history[-(k + 1)] - m0) / rks[k - 1] for k in range(1, order)]
            correction = self._weighted_sum(rhos_c[:-1], D1s) + correction
        x_corrected = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0 - alpha_t * B_h * correction
        return x_corrected.to(x.dtype)


# --------------------------------------------------------------------------- DMD


class DMDSampler(_ShiftedFlowSampler):
    """Few-step loop of a DMD2-distilled flow model (FastVideo's FastWan recipe).

    Per step: predict v; ``x0 = x_t - sigma * v``; if a step remains, move to the next
    sigma — ``"sde"`` (default) re-noises with **fresh** noise ``(1-sigma')*x0 + sigma'*eps``
    (the caller draws ``eps``; ``needs_noise`` says when), ``"ode"`` reuses the noise implied
    by the current sample; after the last step the output is x0.

    Timestep → sigma: FastVideo's ``dmd_denoising_steps_are_scheduler_space`` (default True
    in its ``PipelineConfig``) reads the labels as already living on the shifted training
    table, i.e. ``sigma = t / T`` (FastVideo un-shifts them before ``set_timesteps``, which
    re-shifts, so the shift cancels). With it False the labels are raw and get shifted:
    ``sigma = shift(t / T)``. ``timesteps_are_scheduler_space`` is that flag with that default,
    so with the default the shift only matters for False. The model timestep is ``sigma * T``
    in float32, as FastVideo's scheduler table gives it.
    """

    name: ClassVar[str] = "dmd"

    shift: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 8.0
    denoising_timesteps: tuple[float, ...] = (1000, 757, 522)
    timesteps_are_scheduler_space: bool = True
    sample_type: Literal["sde", "ode"] = "sde"

    @model_validator(mode="after")
    def _check_timesteps(self) -> DMDSampler:
        ts = self.denoising_timesteps
        if not ts:
            raise ValueError("denoising_timesteps must not be empty")
        if any(not (0 < t <= self.num_train_timesteps) or math.isnan(t) for t in ts):
            raise ValueError(f"denoising_timesteps must lie in (0, {self.num_train_timesteps}], got {list(ts)}")
        if any(a <= b for a, b in zip(ts, ts[1:])):
            raise ValueError(f"denoising_timesteps must be strictly decreasing, got {list(ts)}")
        return self

    def init_state(self, num_inference_steps: int) -> SamplerState:
        n = _check_num_steps(num_inference_steps)
        if n != len(self.denoising_timesteps):
            raise SamplerError(
                f"this DMD sampler is distilled for exactly {len(self.denoising_timesteps)} steps "
                f"(denoising_timesteps={list(self.denoising_timesteps)}), got num_inference_steps={n}"
            )
        T = self.num_train_timesteps
        sigmas = torch.tensor(self.denoising_timesteps, dtype=torch.float32) / T
        if not self.timesteps_are_scheduler_space:
            sigmas = shift_sigmas(sigmas, self.shift)
        timesteps = sigmas * T
        sigmas = torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])
        return SamplerState(sampler=self.config_signature(), sigmas=sigmas, timesteps=timesteps)

    def resume_check_steps(self) -> int:
        """Memoryless (2), but never more than the steps it is distilled for: no other trajectory exists."""
        return min(2, len(self.denoising_timesteps))

    def needs_noise(self, state: SamplerState) -> bool:
        return self.sample_type == "sde" and state.step_index + 1 < state.num_steps

    def step(
        self,
        state: SamplerState,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        *,
        noise: torch.Tensor | None = None,
    ) -> tuple[SamplerState, torch.Tensor]:
        self._check_step_inputs(state, model_output, sample, noise)
        i = state.step_index
        sigma = state.sigmas[i]
        x0 = sample - sigma * model_output
        if i + 1 == state.num_steps:
            next_sample = x0
        else:
            sigma_next = state.sigmas[i + 1]
            if self.sample_type == "sde":
                assert noise is not None
                next_sample = add_noise(x0, noise, sigma_next)
            else:
                implied_noise = (sample - (1.0 - sigma) * x0) / sigma.clamp_min(1e-8)
                next_sample = add_noise(x0, implied_noise, sigma_next)
        return state.model_copy(update={"step_index": i + 1}), next_sample


# --------------------------------------------------------------------------- names


def builtin_samplers() -> dict[str, type[Sampler]]:
    """The kernel's built-in samplers by name (a fresh dict; the plugin host registers them)."""
    return {cls.name: cls for cls in (FlowEulerSampler, FlowUniPCSampler, DMDSampler)}


#: The kernel's built-ins by short name and namespaced id (``"fv-kernel/flow_unipc"``): what names
#: resolve through outside a driven loop, the same table the plugin host's kernel registry holds.
_KERNEL_SAMPLERS: Mapping[str, type[Sampler]] = MappingProxyType(
    {key: cls for name, cls in builtin_samplers().items() for key in (name, f"{DISTRIBUTION}/{name}")}
)


# The samplers of the deployment whose instance the current loop runs on. The driver sets
# it around each loop (from ``ModelInstance.registry``); a context variable, so concurrent
# requests on different deployments never see each other's, and no process-wide table exists.
_DEPLOY_SAMPLERS: ContextVar[Mapping[str, type[Sampler]] | None] = ContextVar("fv_deploy_samplers", default=None)


def registered_samplers() -> Mapping[str, type[Sampler]]:
    """The sampler classes code may use here, by short name and namespaced id.

    Inside a loop run by the driver: the samplers of the deployment the instance was built
    for (kernel built-ins plus enabled plugins). Elsewhere: the kernel's built-ins.
    """
    active = _DEPLOY_SAMPLERS.get()
    return active if active is not None else _KERNEL_SAMPLERS


@contextlib.contextmanager
def use_samplers(samplers: Mapping[str, type[Sampler]]) -> Iterator[None]:
    """Resolve sampler names through ``samplers`` (a deploy registry's) inside the block."""
    token = _DEPLOY_SAMPLERS.set(samplers)
    try:
        yield
    finally:
        _DEPLOY_SAMPLERS.reset(token)


def _allowed(samplers: Mapping[str, type[Sampler]]) -> list[str]:
    return sorted(name for name in samplers if "/" not in name)


def sampler_class(name: str) -> type[Sampler]:
    """The registered sampler class ``name`` (short name or ``"<plugin>/<name>"``), or a SamplerError listing the allowed names."""
    samplers = registered_samplers()
    if name not in samplers:
        raise SamplerError(f"sampler {name!r} is not registered in this deployment; allowed: {_allowed(samplers)}")
    return samplers[name]


def bound_sampler(binding: SamplerBinding, *, requested: str | None = None, shift: float | None = None) -> Sampler:
    """The sampler a denoise loop runs for one request.

    ``binding`` is the loop's :class:`~fv_kernel.card.spec.SamplerBinding`: its sampler with
    its config. ``requested`` is the request's ``diffusion.sampler``; when it names another
    sampler (one no loop of the card binds, which ``resolve_request`` accepted because it is
    registered in this deployment), that sampler runs with its own defaults instead. The
    request's ``shift`` overrides the shift of either.
    """
    if requested is not None and sampler_short_name(requested) != sampler_short_name(binding.name):
        sampler_cls, config = sampler_class(requested), {}
    else:
        sampler_cls, config = sampler_class(binding.name), dict(binding.config)
    if shift is not None:
        config["shift"] = shift
    return sampler_cls(**config)


def sampler_from_state(state: SamplerState) -> Sampler:
    """The sampler a state belongs to, rebuilt from the full config its signature records.

    So a loop needs no sampler object of its own: a state restored in another process
    advances with exactly the sampler (and a request's shift override) that made it. The
    name resolves through :func:`registered_samplers` only: a state is data and never
    chooses code, so a name this deployment does not register is refused.
    """
    name, _, config = state.sampler.partition(":")
    samplers = registered_samplers()
    if name not in samplers:
        raise SamplerError(f"state was made by sampler {name!r}, which is not registered here; allowed: {_allowed(samplers)}")
    return samplers[name](**json.loads(config))
