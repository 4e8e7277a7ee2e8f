"""ComfyUI's ``sampler_name`` × ``scheduler`` pairs fv reproduces, as fv samplers.

A ComfyUI sampler only maps to an fv sampler that computes the same numbers: the schedule
(ComfyUI's ``simple`` / ``normal`` / ``sgm_uniform`` schedulers over the flow model's sigma
table, ``ModelSamplingDiscreteFlow`` with ``ModelSamplingSD3``'s shift) and the update:

* ``euler``: k-diffusion's ``sample_euler`` on a ``CONST`` model (``denoised = x - v*sigma``,
  ``d = (x - denoised)/sigma``, ``x += d*(sigma_next - sigma)``);
* ``uni_pc`` / ``uni_pc_bh2``: ComfyUI's own UniPC (``comfy/extra_samplers/uni_pc.py``, variant
  ``bh1`` / ``bh2``) on the ``KSampler`` node's schedule for these samplers: the scheduler's
  sigmas for ``steps + 1`` with the next-to-last one dropped. It is not diffusers' UniPC: it treats the k-diffusion model as a VP model
  through ``SigmaConvert`` (``alpha = 1/sqrt(1+sigma^2)``, half log-SNR ``-log sigma``), works on
  ``x / sqrt(1+sigma^2)``, uses order ``min(3, steps-1)`` with lower-order warm-up and final
  steps, evaluates the model at the predictor's output, corrects every move but the last, and
  moves the final zero sigma to 0.001. ComfyUI's revisions build the ``b`` coefficients in
  different dtypes; ``b_dtype`` picks one: float64 as Comfy-Org/ComfyUI 0748e38 does (the
  default), or float32 as earlier releases do (comfyanonymous/ComfyUI 9bffd67f, v0.3.64).

A state's ``stage_starts`` (a two-expert card's switch step) splits the trajectory into stages
that run as ComfyUI runs a ``KSamplerAdvanced`` chain: each stage is its own sampler call on its
slice of the schedule. The stage's result leaves through CONST's ``inverse_noise_scaling``
(``x / (1 - sigma)``) and enters the next through ``noise_scaling`` with no noise
(``(1 - sigma) * x``); UniPC starts its history, its warm-up orders and its lower-order final
moves afresh in every stage. (ComfyUI's latent-format round trip between the two nodes,
``process_latent_out`` then ``process_latent_in``, is not repeated: it is float rounding only.)

fv's own ``euler``/``unipc`` use diffusers' schedules and formulas, which are different numbers,
so they are not offered as substitutes. Every other ComfyUI sampler (``dpmpp_2m``, ...) and
scheduler (``karras``, ``beta``, ...) is not listed, so a prompt naming one is refused with
``value_not_in_list`` before anything runs.

Written from ComfyUI's ``comfy/samplers.py``, ``comfy/model_sampling.py``,
``comfy/k_diffusion/sampling.py`` and ``comfy/extra_samplers/uni_pc.py``; tests check the sigmas
and the updates against those formulas written out independently.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

import torch
from pydantic import Field

from fv_kernel.api import FlowEulerSampler, Sampler, SamplerState

__all__ = [
    "SAMPLER_NAMES",
    "stage_bounds",
    "SCHEDULER_NAMES",
    "comfy_flow_sigma_table",
    "comfy_sigmas",
    "ksampler_sigmas",
    "fv_sampler_name",
    "ComfyEulerSimple",
    "ComfyEulerNormal",
    "ComfyEulerSgmUniform",
    "ComfyUniPCState",
    "ComfyUniPCSimple",
    "ComfyUniPCNormal",
    "ComfyUniPCSgmUniform",
    "ComfyUniPCBh2Simple",
    "ComfyUniPCBh2Normal",
    "ComfyUniPCBh2SgmUniform",
    "COMFY_SAMPLERS",
]

#: ComfyUI ``sampler_name`` values fv runs exactly.
SAMPLER_NAMES: tuple[str, ...] = ("euler", "uni_pc", "uni_pc_bh2")
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


def stage_bounds(state: SamplerState, index: int) -> tuple[int, int]:
    """``(first, end)`` steps of the stage holding step ``index``: one ComfyUI sampler call's slice."""
    cuts = sorted({0, state.num_steps, *(s for s in state.stage_starts if 0 < s < state.num_steps)})
    first = max(c for c in cuts if c <= index)
    return first, min(c for c in cuts if c > index)


def _stage_hand_off(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """One stage's result into the next stage (ComfyUI's CONST model sampling, zero noise added):
    ``inverse_noise_scaling`` at the end of the first call, ``noise_scaling`` at the start of the next."""
    out = x / (1.0 - sigma)
    return sigma * torch.zeros_like(out) + (1.0 - sigma) * out


#: ComfyUI samplers whose ``KSampler`` schedule is made for one step more, its next-to-last sigma dropped
#: (``KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS``).
_DISCARD_PENULTIMATE = ("uni_pc", "uni_pc_bh2")


def ksampler_sigmas(sampler_name: str, scheduler: str, shift: float, steps: int) -> torch.Tensor:
    """``KSampler.calculate_sigmas``: the schedule a ``KSampler`` / ``KSamplerAdvanced`` node samples."""
    if sampler_name not in _DISCARD_PENULTIMATE:
        return comfy_sigmas(scheduler, shift, steps)
    sigmas = comfy_sigmas(scheduler, shift, steps + 1)
    return torch.cat([sigmas[:-2], sigmas[-1:]])


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
        next_sample = x + d * (sigma_next - sigma)
        if stage_bounds(state, i)[1] == i + 1 < state.num_steps:  # the next step starts another sampler call
            next_sample = _stage_hand_off(next_sample, sigma_next)
        return state.model_copy(update={"step_index": i + 1}), next_sample.to(model_output.dtype)


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


# --------------------------------------------------------------------------- UniPC
# ComfyUI's ``SigmaConvert``: a k-diffusion sigma read as a VP model's time, alpha = 1/sqrt(1+s^2).


def _log_mean_coeff(sigma: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.log(1 / ((sigma * sigma) + 1))


def _vp_alpha(sigma: torch.Tensor) -> torch.Tensor:
    return torch.exp(_log_mean_coeff(sigma))


def _vp_std(sigma: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(1.0 - torch.exp(2.0 * _log_mean_coeff(sigma)))


def _vp_lambda(sigma: torch.Tensor) -> torch.Tensor:
    log_mean_coeff = _log_mean_coeff(sigma)
    return log_mean_coeff - 0.5 * torch.log(1.0 - torch.exp(2.0 * log_mean_coeff))


def _per_sample(v: torch.Tensor, dims: int) -> torch.Tensor:
    """UniPC's ``expand_dims``: a per-sample vector broadcast over the latent's other dims."""
    return v[(...,) + (None,) * (dims - 1)]


def unipc_solver_times(sigmas: torch.Tensor) -> torch.Tensor:
    """The times ComfyUI's ``sample_unipc`` solves at: the schedule with a final 0 moved to 0.001.

    ComfyUI writes the 0.001 into the sigma tensor itself (``timesteps = sigmas[:]`` is a view), so
    the ``inverse_noise_scaling`` that follows the sampler also divides by ``1 - 0.001``.
    """
    times = sigmas.clone()
    if sigmas[-1] == 0:
        times[-1] = 0.001
    return times


class ComfyUniPCState(SamplerState):
    """ComfyUI's UniPC memory between model calls, in UniPC's variables (``x / sqrt(1+sigma^2)``).

    ``history``: ``model_prev_list``, the data predictions of the last ``<= order`` model calls of
    this stage, oldest first. ``base``: the corrected solution at the previous sigma (the next
    corrector's start); at a stage start, the stage's starting ``x`` (the previous stage's result
    handed over), from which the fresh history begins. ``predicted``: the predictor's output at the current sigma, whose scaled value the
    model was called on. ``predicted_order``: the order that predictor used (its corrector reuses it).
    """

    history: list[torch.Tensor] = []
    base: torch.Tensor | None = None
    predicted: torch.Tensor | None = None
    predicted_order: int = 0


class _ComfyUniPC(Sampler):
    """ComfyUI's ``uni_pc`` (B(h) variant ``bh1``) or ``uni_pc_bh2`` on its flow schedule.

    ComfyUI runs the whole trajectory in one call with the model inside; fv calls the model
    between ``step`` calls. The same arithmetic is split at the model calls: step ``i`` receives
    the model's output at the predictor's point for sigma ``i``, applies that move's corrector,
    and returns the predictor's point for sigma ``i+1`` (scaled back to the model's input, as
    ComfyUI's ``predict_eps_sigma`` does), or, after the last move, the final latent.
    """

    state_type: ClassVar[type[SamplerState]] = ComfyUniPCState
    scheduler: ClassVar[str]
    variant: ClassVar[Literal["bh1", "bh2"]]

    shift: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0  # ModelSamplingSD3's shift
    #: The dtype ComfyUI's ``multistep_uni_pc_bh_update`` builds the ``b`` coefficients in, which
    #: depends on the ComfyUI revision: ``float64`` (on the CPU, then cast to float32) in
    #: Comfy-Org/ComfyUI 0748e38; ``float32`` (from the float32 ``expm1(hh)``) in the releases
    #: before it, e.g. comfyanonymous/ComfyUI 9bffd67f and v0.3.64.
    b_dtype: Literal["float64", "float32"] = "float64"

    def init_state(self, num_inference_steps: int) -> ComfyUniPCState:
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        sigmas = ksampler_sigmas("uni_pc", self.scheduler, self.shift, num_inference_steps)
        timesteps = sigmas[:-1] * _MULTIPLIER
        return ComfyUniPCState(sampler=self.config_signature(), sigmas=sigmas, timesteps=timesteps)

    @staticmethod
    def _order(steps: int) -> int:
        return min(3, steps - 1)  # sample_unipc: min(3, len(timesteps) - 2)

    def _move_order(self, move: int, steps: int) -> int:
        """The order of the move to sigma ``move`` (1..steps): warm-up ``move``, lower_order_final."""
        return min(move, self._order(steps), steps + 1 - move)

    @staticmethod
    def _data_prediction(x: torch.Tensor, t: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        """UniPC's ``data_prediction_fn`` of the flow model's velocity at UniPC's ``x``, time ``t``."""
        dims = x.dim()
        sigma = t.view(t.shape[:1] + (1,) * (x.ndim - 1))
        model_input = x * ((sigma**2 + 1.0) ** 0.5)  # predict_eps_sigma
        const_sigma = t.view(()) if t.nelement() == 1 else sigma  # reshape_sigma
        denoised = model_input - velocity * const_sigma  # CONST.calculate_denoised
        eps = (model_input - denoised) / sigma
        return (x - _per_sample(_vp_std(t), dims) * eps) / _per_sample(_vp_alpha(t), dims)

    def _b(self, hh: torch.Tensor, h_phi_1: torch.Tensor, B_h: torch.Tensor, order: int) -> torch.Tensor:
        """The ``b`` vector (``h_phi_k * k! / B(h)``, k = 1..order) in the dtype of :attr:`b_dtype`.

        For small ``hh`` its terms nearly cancel, so the two ComfyUI revisions' results differ in
        the last bits; the result is float32 either way.
        """
        if self.b_dtype == "float64":
            # Comfy-Org/ComfyUI 0748e38: the recurrence from a float64 expm1 of hh, on the CPU.
            hh_ = hh.detach().cpu().double()
            h_phi_k = torch.expm1(hh_) / hh_ - 1
            B_h_ = hh_ if self.variant == "bh1" else torch.expm1(hh_)
        else:
            # earlier ComfyUI: the same recurrence on the float32 tensors (h_phi_1 = expm1(hh)).
            hh_, h_phi_k, B_h_ = hh, h_phi_1 / hh - 1, B_h
        factorial = 1
        terms = []
        for i in range(1, order + 1):
            terms.append(h_phi_k * factorial / B_h_)
            factorial *= i + 1
            h_phi_k = h_phi_k / hh_ - 1 / factorial
        return torch.stack(terms).to(device=hh.device, dtype=hh.dtype)

    def _update(
        self,
        x: torch.Tensor,
        history: list[torch.Tensor],
        history_times: list[torch.Tensor],
        t: torch.Tensor,
        order: int,
        model_t: torch.Tensor | None,
    ) -> torch.Tensor:
        """``multistep_uni_pc_bh_update`` (predict_x0): the predictor, or with ``model_t`` the corrector."""
        dims = x.dim()
        t_prev_0, model_prev_0 = history_times[-1], history[-1]
        lambda_prev_0, lambda_t = _vp_lambda(t_prev_0), _vp_lambda(t)
        sigma_prev_0, sigma_t = _vp_std(t_prev_0), _vp_std(t)
        alpha_t = torch.exp(_log_mean_coeff(t))
        h = lambda_t - lambda_prev_0

        rks, D1s = [], []
        for i in range(1, order):
            rk = ((_vp_lambda(history_times[-(i + 1)]) - lambda_prev_0) / h)[0]
            rks.append(rk)
            D1s.append((history[-(i + 1)] - model_prev_0) / rk)
        rks_t = torch.stack([*rks, torch.tensor(1.0)]) if rks else torch.tensor([1.0])

        hh = -h[0]
        h_phi_1 = torch.expm1(hh)
        B_h = hh if self.variant == "bh1" else torch.expm1(hh)
        R = torch.stack([torch.pow(rks_t, i - 1) for i in range(1, order + 1)])
        b = self._b(hh, h_phi_1, B_h, order)

        D1 = torch.stack(D1s, dim=1) if D1s else None
        x_t_ = _per_sample(sigma_t / sigma_prev_0, dims) * x - _per_sample(alpha_t * h_phi_1, dims) * model_prev_0
        if model_t is None:  # predictor
            if D1 is not None:
                rhos_p = torch.tensor([0.5]) if order == 2 else torch.linalg.solve(R[:-1, :-1], b[:-1])
                pred_res: torch.Tensor | int = torch.tensordot(D1, rhos_p, dims=([1], [0]))
            else:
                pred_res = 0
            return x_t_ - _per_sample(alpha_t * B_h, dims) * pred_res
        rhos_c = torch.tensor([0.5]) if order == 1 else torch.linalg.solve(R, b)
        corr_res: torch.Tensor | int = torch.tensordot(D1, rhos_c[:-1], dims=([1], [0])) if D1 is not None else 0
        D1_t = model_t - model_prev_0
        return x_t_ - _per_sample(alpha_t * B_h, dims) * (corr_res + rhos_c[-1] * D1_t)

    def step(
        self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor, *, noise: torch.Tensor | None = None
    ) -> tuple[ComfyUniPCState, torch.Tensor]:
        self._check_step_inputs(state, model_output, sample, noise)
        assert isinstance(state, ComfyUniPCState)
        i = state.step_index
        # One stage is one ComfyUI sampler call on sigmas[first..end]: its own order, warm-up and
        # lower-order final moves, counted from its first step.
        first, end = stage_bounds(state, i)
        moves = end - first
        times = unipc_solver_times(state.sigmas)  # the 0.001 lands only at the last stage's end
        batch = sample.shape[0]

        def at(k: int) -> torch.Tensor:
            return times[k].expand(batch)

        velocity = model_output.to(torch.float32)
        if i == first:
            if i == 0:
                # sample_unipc: the (noise-scaled) latent enters as x / sqrt(1 + sigma_0^2)
                base = sample.to(torch.float32) / torch.sqrt(1.0 + times[0] ** 2.0)
            else:  # a later stage starts from the x the previous one handed over (kept exactly)
                assert state.base is not None
                base = state.base
            history = [self._data_prediction(base, at(i), velocity)]
        else:
            assert state.predicted is not None and state.base is not None
            model_t = self._data_prediction(state.predicted, at(i), velocity)
            history_times = [at(k) for k in range(i - len(state.history), i)]
            base = self._update(state.base, state.history, history_times, at(i), state.predicted_order, model_t)
            history = [*state.history, model_t][-self._order(moves) :]

        if moves == 1:
            # ComfyUI's order is 0 here: its loop evaluates the model once and moves nowhere.
            return self._stage_end(state, base, end, batch, sample, model_output.dtype)

        move = i + 1
        order = self._move_order(move - first, moves)
        history_times = [at(k) for k in range(move - len(history), move)]
        predicted = self._update(base, history, history_times, at(move), order, None)
        if move == end:  # the stage's last move has no corrector
            return self._stage_end(state, predicted, end, batch, sample, model_output.dtype)
        update = {"step_index": move, "history": history, "base": base, "predicted": predicted, "predicted_order": order}
        return state.model_copy(update=update), self._model_input(predicted, at(move), sample.ndim, model_output.dtype)

    @staticmethod
    def _model_input(x: torch.Tensor, t: torch.Tensor, ndim: int, dtype: torch.dtype) -> torch.Tensor:
        """``predict_eps_sigma``: UniPC's ``x`` at time ``t`` scaled back to the model's input."""
        sigma = t.view((t.shape[0],) + (1,) * (ndim - 1))
        return (x * ((sigma**2 + 1.0) ** 0.5)).to(dtype)

    def _stage_end(
        self, state: ComfyUniPCState, x: torch.Tensor, end: int, batch: int, sample: torch.Tensor, dtype: torch.dtype
    ) -> tuple[ComfyUniPCState, torch.Tensor]:
        """The end of one sampler call at step ``end``: the final latent, or the next stage's start."""
        times = unipc_solver_times(state.sigmas)
        # sample_unipc's x /= alpha(t_end), then CONST's inverse_noise_scaling by the stage's last
        # sigma (the 0.001-overwritten one at the trajectory's end)
        result = (x / _vp_alpha(times[end])) / (1.0 - times[end])
        if end == state.num_steps:
            return state.model_copy(update={"step_index": end}), result.to(dtype)
        # the next KSamplerAdvanced: noise_scaling with no noise, then x / sqrt(1 + sigma^2); history
        # restarts from nothing
        sigma = state.sigmas[end]
        start = (sigma * torch.zeros_like(result) + (1.0 - sigma) * result) / torch.sqrt(1.0 + times[end] ** 2.0)
        update = {"step_index": end, "history": [], "base": start, "predicted": None, "predicted_order": 0}
        return state.model_copy(update=update), self._model_input(start, times[end].expand(batch), sample.ndim, dtype)


class ComfyUniPCSimple(_ComfyUniPC):
    """ComfyUI ``uni_pc`` + ``simple``."""

    name: ClassVar[str] = "comfy-uni_pc-simple"
    scheduler: ClassVar[str] = "simple"
    variant: ClassVar[Literal["bh1", "bh2"]] = "bh1"


class ComfyUniPCNormal(_ComfyUniPC):
    """ComfyUI ``uni_pc`` + ``normal``."""

    name: ClassVar[str] = "comfy-uni_pc-normal"
    scheduler: ClassVar[str] = "normal"
    variant: ClassVar[Literal["bh1", "bh2"]] = "bh1"


class ComfyUniPCSgmUniform(_ComfyUniPC):
    """ComfyUI ``uni_pc`` + ``sgm_uniform``."""

    name: ClassVar[str] = "comfy-uni_pc-sgm_uniform"
    scheduler: ClassVar[str] = "sgm_uniform"
    variant: ClassVar[Literal["bh1", "bh2"]] = "bh1"


class ComfyUniPCBh2Simple(_ComfyUniPC):
    """ComfyUI ``uni_pc_bh2`` + ``simple``."""

    name: ClassVar[str] = "comfy-uni_pc_bh2-simple"
    scheduler: ClassVar[str] = "simple"
    variant: ClassVar[Literal["bh1", "bh2"]] = "bh2"


class ComfyUniPCBh2Normal(_ComfyUniPC):
    """ComfyUI ``uni_pc_bh2`` + ``normal``."""

    name: ClassVar[str] = "comfy-uni_pc_bh2-normal"
    scheduler: ClassVar[str] = "normal"
    variant: ClassVar[Literal["bh1", "bh2"]] = "bh2"


class ComfyUniPCBh2SgmUniform(_ComfyUniPC):
    """ComfyUI ``uni_pc_bh2`` + ``sgm_uniform``."""

    name: ClassVar[str] = "comfy-uni_pc_bh2-sgm_uniform"
    scheduler: ClassVar[str] = "sgm_uniform"
    variant: ClassVar[Literal["bh1", "bh2"]] = "bh2"


#: Every sampler the plugin registers, with the ComfyUI ``sampler_name`` each one runs.
COMFY_SAMPLERS: tuple[type[_ComfyEuler] | type[_ComfyUniPC], ...] = (
    ComfyEulerSimple,
    ComfyEulerNormal,
    ComfyEulerSgmUniform,
    ComfyUniPCSimple,
    ComfyUniPCNormal,
    ComfyUniPCSgmUniform,
    ComfyUniPCBh2Simple,
    ComfyUniPCBh2Normal,
    ComfyUniPCBh2SgmUniform,
)


def fv_sampler_name(sampler_name: str, scheduler: str) -> str:
    """The fv sampler that runs ComfyUI's ``sampler_name`` with ``scheduler``; ValueError when none does."""
    if sampler_name in SAMPLER_NAMES and scheduler in SCHEDULER_NAMES:
        return f"comfy-{sampler_name}-{scheduler}"  # the name of one of COMFY_SAMPLERS (a test checks each)
    raise ValueError(
        f"no fv sampler computes ComfyUI's {sampler_name!r} with scheduler {scheduler!r}; "
        f"allowed: sampler_name {list(SAMPLER_NAMES)}, scheduler {list(SCHEDULER_NAMES)}"
    )
