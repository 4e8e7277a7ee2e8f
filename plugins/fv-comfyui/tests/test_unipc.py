"""ComfyUI's ``uni_pc`` / ``uni_pc_bh2`` as fv samplers, against ComfyUI's algorithm written out here
independently: KSAMPLER's noise scaling, ``sample_unipc`` (its SigmaConvert VP view, the 0.001 final
time written into the sigmas, order min(3, steps-1)), ``UniPC.sample``'s multistep loop with the model
called inside the update, ``multistep_uni_pc_bh_update``'s predictor and corrector, and CONST's
``inverse_noise_scaling`` by the overwritten last sigma. The fv sampler is driven the way fv's
denoise loop drives it (one model call, then ``step``)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from fv_kernel.api import FlowUniPCSampler
from fv_comfyui.samplers import (
    COMFY_SAMPLERS,
    ComfyUniPCBh2Simple,
    ComfyUniPCSimple,
    ComfyUniPCState,
    comfy_sigmas,
)

UNIPC = [cls for cls in COMFY_SAMPLERS if issubclass(cls.state_type, ComfyUniPCState)]
_W = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)) * 0.3


def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A deterministic, nonlinear stand-in for the flow model's (guided) velocity."""
    s = sigma.reshape(-1, *([1] * (x.ndim - 1)))
    return torch.tanh(torch.einsum("ij,bj...->bi...", _W, x)) + s * x * 0.5 - 0.2


def const_denoiser(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """ComfyUI's k-diffusion model of a CONST (flow) model: ``x - v * sigma``."""
    s = sigma.view(()) if sigma.nelement() == 1 else sigma.view(sigma.shape[:1] + (1,) * (x.ndim - 1))
    return x - velocity(x, sigma) * s


def comfy_uni_pc(
    denoiser: Callable[..., torch.Tensor], noise: torch.Tensor, sigmas: torch.Tensor, variant: str, *, corrector: bool = True
) -> torch.Tensor:
    sigmas = sigmas.clone()
    x_k = sigmas[0] * (1.0 * noise) + (1.0 - sigmas[0]) * torch.zeros_like(noise)  # CONST.noise_scaling, empty latent
    ts = sigmas[:]  # a view, as in ComfyUI: the 0.001 lands in sigmas too
    if sigmas[-1] == 0:
        ts[-1] = 0.001

    def lmc(s: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.log(1 / ((s * s) + 1))

    def alpha(s: torch.Tensor) -> torch.Tensor:
        return torch.exp(lmc(s))

    def std(s: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(1.0 - torch.exp(2.0 * lmc(s)))

    def lam(s: torch.Tensor) -> torch.Tensor:
        return lmc(s) - 0.5 * torch.log(1.0 - torch.exp(2.0 * lmc(s)))

    def ex(v: torch.Tensor, d: int) -> torch.Tensor:
        return v[(...,) + (None,) * (d - 1)]

    x = x_k / torch.sqrt(1.0 + ts[0] ** 2.0)
    batch = x.shape[0]

    def model_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # noise model -> data prediction
        s = t.view(t.shape[:1] + (1,) * (x.ndim - 1))
        inp = x * ((s**2 + 1.0) ** 0.5)
        eps = (inp - denoiser(inp, t)) / s
        return (x - ex(std(t), x.dim()) * eps) / ex(alpha(t), x.dim())

    def update(x: torch.Tensor, M: list, T: list, t: torch.Tensor, order: int, use_corrector: bool) -> tuple[Any, Any]:
        d = x.dim()
        l0, h = lam(T[-1]), lam(t) - lam(T[-1])
        rks, D1s = [], []
        for i in range(1, order):
            rk = ((lam(T[-(i + 1)]) - l0) / h)[0]
            rks.append(rk)
            D1s.append((M[-(i + 1)] - M[-1]) / rk)
        rks_t = torch.tensor([float(r) for r in rks] + [1.0])
        hh = -h[0]
        h_phi_1 = torch.expm1(hh)
        B_h = hh if variant == "bh1" else torch.expm1(hh)
        hh64 = hh.double()
        hk = torch.expm1(hh64) / hh64 - 1
        B_h64 = hh64 if variant == "bh1" else torch.expm1(hh64)
        R, b, fac = [], [], 1
        for i in range(1, order + 1):
            R.append(rks_t ** (i - 1))
            b.append(float(hk * fac / B_h64))
            fac *= i + 1
            hk = hk / hh64 - 1 / fac
        R_t, b_t = torch.stack(R), torch.tensor(b, dtype=torch.float32)
        xt_ = ex(std(t) / std(T[-1]), d) * x - ex(alpha(t) * h_phi_1, d) * M[-1]
        D = torch.stack(D1s, dim=1) if D1s else None
        if D is not None:
            rp = torch.tensor([0.5]) if order == 2 else torch.linalg.solve(R_t[:-1, :-1], b_t[:-1])
            xt = xt_ - ex(alpha(t) * B_h, d) * torch.tensordot(D, rp, dims=([1], [0]))
        else:
            xt = xt_ - ex(alpha(t) * B_h, d) * 0
        mt = None
        if use_corrector and not corrector:  # negative control only: model called, correction dropped
            return xt, model_fn(xt, t)
        if use_corrector:
            rc = torch.tensor([0.5]) if order == 1 else torch.linalg.solve(R_t, b_t)
            mt = model_fn(xt, t)  # the model is called at the predictor's output
            cr = torch.tensordot(D, rc[:-1], dims=([1], [0])) if D is not None else 0
            xt = xt_ - ex(alpha(t) * B_h, d) * (cr + rc[-1] * (mt - M[-1]))
        return xt, mt

    steps = len(ts) - 1
    order = min(3, len(ts) - 2)
    for si in range(steps):
        if si == 0:
            vt = ts[0].expand(batch)
            M, T = [model_fn(x, vt)], [vt]
        elif si < order:
            vt = ts[si].expand(batch)
            x, mx = update(x, M, T, vt, si, True)
            M.append(mx)
            T.append(vt)
        else:
            for st in range(si, si + 1 + (1 if si == steps - 1 else 0)):
                vt = ts[st].expand(batch)
                x, mx = update(x, M, T, vt, min(order, steps + 1 - st), st != steps)
                for i in range(order - 1):
                    T[i], M[i] = T[i + 1], M[i + 1]
                T[-1] = vt
                if st < steps:
                    M[-1] = mx
    x = x / alpha(ts[-1])
    return x / (1.0 - sigmas[-1])  # CONST.inverse_noise_scaling by the overwritten last sigma


def initial_noise(seed: int, sigma0: torch.Tensor) -> torch.Tensor:
    # ComfyUI's first model input is the noise divided and multiplied by sqrt(1 + sigma_0^2); fv's
    # loop feeds the noise as drawn. They differ by an ulp at most; a fixed point of that round
    # trip makes both models see the same input, so the comparison can be bit for bit.
    noise = torch.randn(1, 4, 2, 3, 3, generator=torch.Generator().manual_seed(seed))
    for _ in range(8):
        noise = (noise / torch.sqrt(1.0 + sigma0**2.0)) * ((sigma0**2 + 1.0) ** 0.5)
    return noise


def run_fv(sampler: Any, noise: torch.Tensor, steps: int) -> torch.Tensor:
    state, x = sampler.init_state(steps), noise.clone()
    while not sampler.is_done(state):
        if isinstance(state, ComfyUniPCState):  # the model's timestep: ModelSamplingDiscreteFlow.timestep
            assert torch.equal(sampler.timestep(state), state.sigmas[state.step_index] * 1000)
        state, x = sampler.step(state, velocity(x, state.sigmas[state.step_index].reshape(1)), x)
    return x


@pytest.mark.parametrize("cls", UNIPC, ids=lambda c: c.name)
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 8])
def test_trajectory_is_comfyuis_bit_for_bit(cls: Any, steps: int) -> None:
    # 1..3 steps: the warm-up orders and the steps==1 quirk; 4+: order 3 and the lower-order final moves.
    shift = 8.0
    sigmas = comfy_sigmas(cls.scheduler, shift, steps)
    noise = initial_noise(steps, sigmas[0])
    expected = comfy_uni_pc(const_denoiser, noise, sigmas, cls.variant)
    got = run_fv(cls(shift=shift), noise, steps)
    assert torch.equal(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("steps", [3, 6])
def test_negative_control_bh1_and_bh2_swapped_fail(steps: int) -> None:
    sigmas = comfy_sigmas("simple", 5.0, steps)
    noise = initial_noise(0, sigmas[0])
    for cls, wrong in ((ComfyUniPCSimple, "bh2"), (ComfyUniPCBh2Simple, "bh1")):
        assert not torch.allclose(run_fv(cls(shift=5.0), noise, steps), comfy_uni_pc(const_denoiser, noise, sigmas, wrong), atol=1e-4)


def test_negative_control_the_corrector_is_seen() -> None:
    # The reference without its corrector (the model still called at each predicted point) must
    # not match, so the bit-for-bit test above checks the corrector too; ComfyUI calls the model
    # once per step, as fv's loop does.
    sigmas = comfy_sigmas("simple", 5.0, 6)
    noise = initial_noise(1, sigmas[0])
    got = run_fv(ComfyUniPCSimple(shift=5.0), noise, 6)
    calls: list[int] = []

    def counting(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return const_denoiser(x, t)

    assert torch.equal(got, comfy_uni_pc(counting, noise, sigmas, "bh1")) and len(calls) == 6
    assert not torch.allclose(got, comfy_uni_pc(const_denoiser, noise, sigmas, "bh1", corrector=False), atol=1e-4)


def test_fvs_builtin_unipc_is_not_comfyuis() -> None:
    # fv's unipc (diffusers' UniPCMultistepScheduler, flow sigmas) is another schedule and another
    # half log-SNR (log(1-sigma) - log(sigma) rather than -log(sigma)); it is never a substitute.
    steps, shift = 6, 8.0
    ours = FlowUniPCSampler(shift=shift, solver_type="bh1").init_state(steps).sigmas
    comfy = comfy_sigmas("simple", shift, steps)
    assert not torch.allclose(ours, comfy, atol=1e-4)
    noise = initial_noise(2, comfy[0])
    diffusers_like = run_fv(FlowUniPCSampler(shift=shift, solver_type="bh2"), noise, steps)
    assert not torch.allclose(diffusers_like, comfy_uni_pc(const_denoiser, noise, comfy, "bh2"), atol=1e-3)


def test_state_round_trips_mid_trajectory() -> None:
    sampler = ComfyUniPCBh2Simple(shift=8.0)
    sigmas = comfy_sigmas("simple", 8.0, 5)
    noise = initial_noise(3, sigmas[0])
    state, x = sampler.init_state(5), noise.clone()
    for _ in range(2):
        state, x = sampler.step(state, velocity(x, state.sigmas[state.step_index].reshape(1)), x)
    restored = ComfyUniPCState.from_bytes(state.to_bytes())
    assert isinstance(restored, ComfyUniPCState) and len(restored.history) == 2
    while not sampler.is_done(restored):
        restored, x = sampler.step(restored, velocity(x, restored.sigmas[restored.step_index].reshape(1)), x)
    assert torch.equal(x, run_fv(sampler, noise, 5))
