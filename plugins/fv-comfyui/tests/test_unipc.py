"""ComfyUI's ``uni_pc`` / ``uni_pc_bh2`` as fv samplers, against ComfyUI's algorithm written out here
independently: KSAMPLER's noise scaling, ``sample_unipc`` (its SigmaConvert VP view, the 0.001 final
time written into the sigmas, order min(3, steps-1)), ``UniPC.sample``'s multistep loop with the model
called inside the update, ``multistep_uni_pc_bh_update``'s predictor and corrector, and CONST's
``inverse_noise_scaling`` by the overwritten last sigma. The fv sampler is driven the way fv's
denoise loop drives it (one model call, then ``step``).

ComfyUI's revisions differ in one place: the dtype of ``b``. Comfy-Org/ComfyUI 0748e38 runs the
recurrence in float64 (``hh.detach().cpu().double()``) and casts the list to float32; the releases
before it (comfyanonymous/ComfyUI 9bffd67f, v0.3.64) run it on the float32 0-d tensors, starting from
``expm1(hh)``, and ``torch.tensor`` the list. The reference below writes out each revision's own
arithmetic (chosen by ``revision``), not the sampler's ``b_dtype`` code path."""

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


def node_sigmas(scheduler: str, shift: float, steps: int) -> torch.Tensor:
    """The sigmas a KSampler node samples uni_pc with: ``KSampler.calculate_sigmas`` puts uni_pc in
    ``DISCARD_PENULTIMATE_SIGMA_SAMPLERS``, so the scheduler runs for steps + 1 and the next-to-last
    sigma is dropped."""
    longer = comfy_sigmas(scheduler, shift, steps + 1)
    return torch.cat([longer[:-2], longer[-1:]])
_W = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)) * 0.3


def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A deterministic, nonlinear stand-in for the flow model's (guided) velocity."""
    s = sigma.reshape(-1, *([1] * (x.ndim - 1)))
    return torch.tanh(torch.einsum("ij,bj...->bi...", _W, x)) + s * x * 0.5 - 0.2


def const_denoiser(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """ComfyUI's k-diffusion model of a CONST (flow) model: ``x - v * sigma``."""
    s = sigma.view(()) if sigma.nelement() == 1 else sigma.view(sigma.shape[:1] + (1,) * (x.ndim - 1))
    return x - velocity(x, sigma) * s


#: ComfyUI revision -> the sampler's ``b_dtype`` that runs its arithmetic.
REVISIONS = {"0748e38": "float64", "9bffd67f": "float32"}


def comfy_uni_pc(
    denoiser: Callable[..., torch.Tensor],
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    variant: str,
    *,
    revision: str,
    corrector: bool = True,
    latent: torch.Tensor | None = None,
) -> torch.Tensor:
    """One KSAMPLER call with ``sample_unipc`` on ``sigmas``, from ``latent`` (default: empty)."""
    sigmas = sigmas.clone()
    latent = torch.zeros_like(noise) if latent is None else latent
    x_k = sigmas[0] * (1.0 * noise) + (1.0 - sigmas[0]) * latent  # CONST.noise_scaling
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
        rks_t = torch.tensor([*rks, 1.0])  # 0-d float32 tensors and a float: a float32 vector
        hh = -h[0]
        h_phi_1 = torch.expm1(hh)
        if variant == "bh1":
            B_h = hh
        else:
            B_h = torch.expm1(hh)
        if revision == "9bffd67f":  # all float32: phi recurrence on the 0-d float32 tensors
            hk, hh_r, B_h_r = h_phi_1 / hh - 1, hh, B_h
        else:  # 0748e38: float64 copies of hh, recurrence in float64, the list cast to float32
            hh_r = hh.detach().cpu().double()
            hk = torch.expm1(hh_r) / hh_r - 1
            B_h_r = hh_r if variant == "bh1" else torch.expm1(hh_r)
        R, b, fac = [], [], 1
        for i in range(1, order + 1):
            R.append(torch.pow(rks_t, i - 1))
            b.append(hk * fac / B_h_r)
            fac *= i + 1
            hk = hk / hh_r - 1 / fac
        R_t = torch.stack(R)
        b_t = torch.tensor(b) if revision == "9bffd67f" else torch.tensor(b, dtype=hh.dtype)
        assert b_t.dtype == torch.float32
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


def initial_noise(seed: int, sigma0: torch.Tensor, *, as_drawn: bool = False) -> torch.Tensor:
    # ComfyUI's first model input is the noise divided and multiplied by sqrt(1 + sigma_0^2); fv's
    # loop feeds the noise as drawn. They differ by an ulp at most; a fixed point of that round
    # trip makes both models see the same input, so the comparison can be bit for bit.
    noise = torch.randn(1, 4, 2, 3, 3, generator=torch.Generator().manual_seed(seed))
    for _ in range(0 if as_drawn else 8):
        noise = (noise / torch.sqrt(1.0 + sigma0**2.0)) * ((sigma0**2 + 1.0) ** 0.5)
    return noise


def recording(calls: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., torch.Tensor]:
    """``const_denoiser`` that keeps each model input and sigma."""

    def denoiser(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        calls.append((x.clone(), sigma.clone()))
        return const_denoiser(x, sigma)

    return denoiser


def run_fv(sampler: Any, noise: torch.Tensor, steps: int, calls: list | None = None) -> torch.Tensor:
    state, x = sampler.init_state(steps), noise.clone()
    while not sampler.is_done(state):
        if isinstance(state, ComfyUniPCState):  # the model's timestep: ModelSamplingDiscreteFlow.timestep
            assert torch.equal(sampler.timestep(state), state.sigmas[state.step_index] * 1000)
        sigma = state.sigmas[state.step_index].reshape(1)
        if calls is not None:
            calls.append((x.clone(), sigma.clone()))
        state, x = sampler.step(state, velocity(x, sigma), x)
    return x


# 1..3 steps: the warm-up orders and the steps==1 quirk (no move at all); 4: order 3 for one move;
# 5+: order 3 with lower-order final moves; 30 (the fixture's count): long runs, small h at the end.
STEPS = [1, 2, 3, 4, 5, 6, 8, 13, 30]
SHIFTS = [1.0, 8.0]


@pytest.mark.parametrize("revision", list(REVISIONS))
@pytest.mark.parametrize("cls", UNIPC, ids=lambda c: c.name)
@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("shift", SHIFTS)
def test_trajectory_is_comfyuis_bit_for_bit(cls: Any, revision: str, steps: int, shift: float) -> None:
    """Every model input (the whole trajectory) and the result equal the revision's, bit for bit."""
    sigmas = node_sigmas(cls.scheduler, shift, steps)
    noise = initial_noise(steps, sigmas[0])
    comfy_calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    fv_calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    expected = comfy_uni_pc(recording(comfy_calls), noise, sigmas, cls.variant, revision=revision)
    got = run_fv(cls(shift=shift, b_dtype=REVISIONS[revision]), noise, steps, fv_calls)
    assert len(fv_calls) == len(comfy_calls) == steps  # one model call per step, as in ComfyUI
    for i, ((x_fv, s_fv), (x_comfy, s_comfy)) in enumerate(zip(fv_calls, comfy_calls)):
        assert torch.equal(s_fv, s_comfy), (i, s_fv, s_comfy)
        assert torch.equal(x_fv, x_comfy), f"model input {i}: max abs diff {(x_fv - x_comfy).abs().max().item():.3g}"
    assert torch.equal(got, expected), f"result: max abs diff {(got - expected).abs().max().item():.3g}"


@pytest.mark.parametrize("cls", UNIPC, ids=lambda c: c.name)
def test_the_schedule_is_the_ksampler_nodes(cls: Any) -> None:
    for steps in (1, 2, 6, 30):
        sigmas = cls(shift=8.0).init_state(steps).sigmas
        assert torch.equal(sigmas, node_sigmas(cls.scheduler, 8.0, steps)) and len(sigmas) == steps + 1
        # Negative control: the scheduler's own sigmas for `steps` are not what the node samples.
        assert steps == 1 or not torch.equal(sigmas, comfy_sigmas(cls.scheduler, 8.0, steps))


def test_default_is_the_newest_revision() -> None:
    assert all(cls().b_dtype == REVISIONS["0748e38"] for cls in UNIPC)
    with pytest.raises(ValueError):
        ComfyUniPCSimple(b_dtype="float16")


#: Bounds on the largest |difference| between the two revisions' results over the cases below
#: (measured: simple 8.3e-7, normal 5.0e-6, sgm_uniform 9.5e-7); docs/comfyui.md quotes these.
REVISION_GAP = {"simple": 2e-6, "normal": 1e-5, "sgm_uniform": 2e-6}


@pytest.mark.parametrize("scheduler", list(REVISION_GAP))
def test_the_two_revisions_differ_and_by_how_much(scheduler: str) -> None:
    # The reference tells the revisions apart (so the bit-for-bit test checks b's dtype), and
    # the gap between them stays at float32 rounding of b propagated through the run.
    worst, differing = 0.0, 0
    for cls in (c for c in UNIPC if c.scheduler == scheduler):
        for steps in (3, 4, 6, 8, 13, 30):
            for shift in SHIFTS:
                sigmas = node_sigmas(scheduler, shift, steps)
                noise = initial_noise(steps, sigmas[0])
                new = comfy_uni_pc(const_denoiser, noise, sigmas, cls.variant, revision="0748e38")
                old = comfy_uni_pc(const_denoiser, noise, sigmas, cls.variant, revision="9bffd67f")
                gap = (new - old).abs().max().item()
                worst, differing = max(worst, gap), differing + (gap > 0)
                if gap > 0 and shift == 8.0:  # the sampler with the other revision's b is caught
                    assert not torch.equal(run_fv(cls(shift=shift), noise, steps), old)
                    assert not torch.equal(run_fv(cls(shift=shift, b_dtype="float32"), noise, steps), new)
    assert differing >= 12, differing  # most runs of 3+ steps differ somewhere
    assert 0 < worst <= REVISION_GAP[scheduler], worst


def test_noise_as_drawn_is_within_rounding() -> None:
    # Without the fixed point above, the first model input differs by up to an ulp and the runs
    # drift apart by rounding (measured: up to 5.3e-6, normal); fv's loop passes the noise as drawn.
    worst = 0.0
    for cls in UNIPC:
        for steps in (1, 3, 6, 13):
            sigmas = node_sigmas(cls.scheduler, 8.0, steps)
            noise = initial_noise(100 + steps, sigmas[0], as_drawn=True)
            expected = comfy_uni_pc(const_denoiser, noise, sigmas, cls.variant, revision="0748e38")
            worst = max(worst, (run_fv(cls(shift=8.0), noise, steps) - expected).abs().max().item())
    assert worst <= 2e-5, worst


@pytest.mark.parametrize("steps", [3, 6])
def test_negative_control_bh1_and_bh2_swapped_fail(steps: int) -> None:
    sigmas = node_sigmas("simple", 5.0, steps)
    noise = initial_noise(0, sigmas[0])
    for cls, wrong in ((ComfyUniPCSimple, "bh2"), (ComfyUniPCBh2Simple, "bh1")):
        expected = comfy_uni_pc(const_denoiser, noise, sigmas, wrong, revision="0748e38")
        assert not torch.allclose(run_fv(cls(shift=5.0), noise, steps), expected, atol=1e-4)


def test_negative_control_the_corrector_is_seen() -> None:
    # The reference without its corrector (the model still called at each predicted point) must
    # not match, so the bit-for-bit test above checks the corrector too; ComfyUI calls the model
    # once per step, as fv's loop does.
    sigmas = node_sigmas("simple", 5.0, 6)
    noise = initial_noise(1, sigmas[0])
    got = run_fv(ComfyUniPCSimple(shift=5.0), noise, 6)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    assert torch.equal(got, comfy_uni_pc(recording(calls), noise, sigmas, "bh1", revision="0748e38")) and len(calls) == 6
    no_corrector = comfy_uni_pc(const_denoiser, noise, sigmas, "bh1", revision="0748e38", corrector=False)
    assert not torch.allclose(got, no_corrector, atol=1e-4)


def test_fvs_builtin_unipc_is_not_comfyuis() -> None:
    # fv's unipc (diffusers' UniPCMultistepScheduler, flow sigmas) is another schedule and another
    # half log-SNR (log(1-sigma) - log(sigma) rather than -log(sigma)); it is never a substitute.
    steps, shift = 6, 8.0
    ours = FlowUniPCSampler(shift=shift, solver_type="bh1").init_state(steps).sigmas
    comfy = node_sigmas("simple", shift, steps)
    assert not torch.allclose(ours, comfy, atol=1e-4)
    noise = initial_noise(2, comfy[0])
    diffusers_like = run_fv(FlowUniPCSampler(shift=shift, solver_type="bh2"), noise, steps)
    assert not torch.allclose(diffusers_like, comfy_uni_pc(const_denoiser, noise, comfy, "bh2", revision="0748e38"), atol=1e-3)


def test_state_round_trips_mid_trajectory() -> None:
    sampler = ComfyUniPCBh2Simple(shift=8.0)
    sigmas = node_sigmas("simple", 8.0, 5)
    noise = initial_noise(3, sigmas[0])
    state, x = sampler.init_state(5), noise.clone()
    for _ in range(2):
        state, x = sampler.step(state, velocity(x, state.sigmas[state.step_index].reshape(1)), x)
    restored = ComfyUniPCState.from_bytes(state.to_bytes())
    assert isinstance(restored, ComfyUniPCState) and len(restored.history) == 2
    while not sampler.is_done(restored):
        restored, x = sampler.step(restored, velocity(x, restored.sigmas[restored.step_index].reshape(1)), x)
    assert torch.equal(x, run_fv(sampler, noise, 5))
