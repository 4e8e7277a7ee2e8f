"""fv's Flow-GRPO SDE step checked against an independent statement of flow_grpo's ``sde_step_with_logprob``.

The reference below restates flow_grpo's arithmetic (``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``,
``sde_type='sde'``; summarised in ``shared/reference/rl.md``) and shares nothing with ``fv_rl.sde``:

    dt        = sigma' - sigma                                     (< 0)
    std_dev_t = a * sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))),   sigma_max = sigmas[1]
    mean      = x (1 + std_dev_t^2 / (2 sigma) dt) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt
    x'        = mean + std_dev_t sqrt(-dt) eps
    log_prob  = mean over all non-batch dims of
                -(x' - mean)^2 / (2 (std_dev_t sqrt(-dt))^2) - log(std_dev_t sqrt(-dt)) - log(sqrt(2 pi))

fv's ``sde_mean_std`` returns the step's whole std, ``std_dev_t * sqrt(-dt)``; flow_grpo returns
``std_dev_t`` alone and multiplies by ``sqrt(-dt)`` where it uses it. The reference compares like with like.

Precision. The reference runs in float64 (python floats for the scalars, float64 tensors). fv computes in
float32 by design (as flow_grpo does), so the comparison cannot be bit-exact: it uses tolerances of order 1e-5
(about 80 float32 ulps; see _MEAN_TOL), 5-20x the error fv actually shows and far below what a wrong term moves
(``test_the_tolerance_is_far_below_what_a_wrong_term_moves``). The *inputs* both sides see are identical: the
sigmas are float32 numbers (fv's schedule is float32) and x, v, eps, x' are float32 tensors; the reference
widens those exact values to float64 and nothing else.
"""

from __future__ import annotations

import math

import pytest
import torch

from fv_rl.sde import FlowSDESampler, gaussian_log_prob, sde_mean_std

# ----------------------------------------------------------------------------- the reference (float64)


def _f32(value: float) -> float:
    """The float32 number nearest ``value``, as a python float: the sigma both sides are given."""
    return float(torch.tensor(value, dtype=torch.float32))


def ref_std_dev_t(sigma: float, noise_level: float, sigma_max: float) -> float:
    """flow_grpo's ``std_dev_t``: at sigma == 1 the denominator uses sigma_max (the schedule's sigmas[1])."""
    denominator = 1.0 - (sigma_max if sigma == 1.0 else sigma)
    return noise_level * math.sqrt(sigma / denominator)


def ref_mean_std(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, noise_level: float,
                 sigma_max: float) -> tuple[torch.Tensor, float]:
    """(prev_sample_mean, std_dev_t * sqrt(-dt)) of flow_grpo's SDE step, in float64."""
    x, v = x.to(torch.float64), v.to(torch.float64)
    dt = sigma_next - sigma
    s = ref_std_dev_t(sigma, noise_level, sigma_max)
    mean = x * (1.0 + s * s / (2.0 * sigma) * dt) + v * (1.0 + s * s * (1.0 - sigma) / (2.0 * sigma)) * dt
    return mean, s * math.sqrt(-dt)


def ref_log_prob(next_sample: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """flow_grpo's per-element Gaussian log-density, with its -log(sqrt(2 pi)), averaged over non-batch dims."""
    diff = next_sample.to(torch.float64) - mean
    per_element = -(diff**2) / (2.0 * std**2) - math.log(std) - math.log(math.sqrt(2.0 * math.pi))
    return per_element.mean(dim=tuple(range(1, per_element.ndim)))


# ----------------------------------------------------------------------------- cases

# (sigma, sigma_next, sigma_max): sigma = 1 (the sigma_max substitution), near 1, the middle, near 0 and the
# last step (sigma' = 0). sigma_max matters only at sigma == 1; elsewhere a value that would be wrong if used.
_SIGMA_CASES = [
    (1.0, 0.95, 0.95),
    (1.0, 0.75, 0.75),
    (0.999, 0.99, 0.3),
    (0.8, 0.6, 0.3),
    (0.5, 0.45, 0.3),
    (0.2, 0.1, 0.3),
    (0.05, 0.02, 0.3),
    (0.02, 0.0, 0.3),
    (0.001, 0.0, 0.3),
]
_NOISE_LEVELS = [0.3, 0.7, 1.2]
_CASES = [(*map(_f32, c), a) for c in _SIGMA_CASES for a in _NOISE_LEVELS]
_IDS = [f"sigma={s:g}->{n:g}-a={a:g}" for s, n, _, a in _CASES]

# float32 tolerances (see the module docstring), ~5-20x the largest error fv shows on these cases (measured:
# mean 2e-6 abs at sigma 0.999 where the coefficients are large; std 1.2e-7 relative; log-prob 3.4e-5 abs).
# The log-prob is looser because it divides the float32 mean's error by std (down to 3e-4 here).
_MEAN_TOL = dict(rtol=1e-5, atol=1e-5)
_STD_RTOL = 2e-6
_LOGP_TOL = dict(rtol=1e-5, atol=2e-4)


def _inputs(seed: int, shape=(3, 4, 2, 5, 6)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, v, eps = (torch.randn(shape, generator=g) for _ in range(3))
    return x, 2.0 * v, eps  # velocities somewhat larger than the sample, as a model's often are


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float, atol: float) -> None:
    torch.testing.assert_close(actual.to(torch.float64), expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} differs from flow_grpo's: {m}")


# ----------------------------------------------------------------------------- sde_mean_std / gaussian_log_prob


@pytest.mark.parametrize(("sigma", "sigma_next", "sigma_max", "a"), _CASES, ids=_IDS)
def test_mean_matches_flow_grpo(sigma, sigma_next, sigma_max, a):
    x, v, _ = _inputs(10)
    mean, _ = sde_mean_std(x, v, sigma, sigma_next, a, sigma_max)
    ref_mean, _ = ref_mean_std(x, v, sigma, sigma_next, a, sigma_max)
    assert mean.shape == x.shape
    _close(mean, ref_mean, "mean", **_MEAN_TOL)


@pytest.mark.parametrize(("sigma", "sigma_next", "sigma_max", "a"), _CASES, ids=_IDS)
def test_std_matches_flow_grpo(sigma, sigma_next, sigma_max, a):
    x, v, _ = _inputs(11)
    _, std = sde_mean_std(x, v, sigma, sigma_next, a, sigma_max)
    _, ref_std = ref_mean_std(x, v, sigma, sigma_next, a, sigma_max)
    assert std.numel() == 1
    assert float(std) == pytest.approx(ref_std, rel=_STD_RTOL, abs=0), "std differs from flow_grpo's"


@pytest.mark.parametrize(("sigma", "sigma_next", "sigma_max", "a"), _CASES, ids=_IDS)
def test_log_prob_matches_flow_grpo(sigma, sigma_next, sigma_max, a):
    """fv's log-prob of x' (fv's mean and std) against flow_grpo's (the reference's), at x' drawn from the step
    and at x' moved off it, where the quadratic term dominates."""
    x, v, eps = _inputs(12)
    ref_mean, ref_std = ref_mean_std(x, v, sigma, sigma_next, a, sigma_max)
    mean, std = sde_mean_std(x, v, sigma, sigma_next, a, sigma_max)
    for scale, offset in [(1.0, 0.0), (0.5, 2.0)]:
        next_sample = (ref_mean + ref_std * (scale * eps.double() + offset)).float()
        lp = gaussian_log_prob(next_sample, mean, std)
        assert lp.shape == (x.shape[0],)
        _close(lp, ref_log_prob(next_sample, ref_mean, ref_std), f"log-prob (scale {scale}, offset {offset})",
               **_LOGP_TOL)


def test_gaussian_log_prob_is_flow_grpos_density_given_the_same_mean_and_std():
    """The density alone, isolated from the mean/std: the constant, the log(std) and the average over dims."""
    g = torch.Generator().manual_seed(13)
    mean = torch.randn(4, 3, 2, 7, generator=g)
    next_sample = mean + 0.3 * torch.randn(4, 3, 2, 7, generator=g)
    for std in [1e-3, 0.05, 0.3, 1.0, 4.0]:
        std32 = _f32(std)
        lp = gaussian_log_prob(next_sample, mean, torch.tensor(std32))
        _close(lp, ref_log_prob(next_sample, mean.double(), std32), f"log-prob at std {std}", rtol=1e-5, atol=1e-4)
    # at x' = mean the value is exactly the normaliser: -log(std) - log(sqrt(2 pi))
    lp = gaussian_log_prob(mean, mean, torch.tensor(0.25))
    _close(lp, torch.full((4,), -math.log(0.25) - 0.5 * math.log(2 * math.pi), dtype=torch.float64),
           "log-prob at the mean", rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- the sampler (schedule, sigma_max)


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("a", [0.7, 1.2])
def test_every_sampler_step_and_log_prob_match_flow_grpo(shift, a):
    """FlowSDESampler over a whole schedule: x' = mean + std * eps and log p(x'|x), with sigma_max = sigmas[1]
    at the sigma = 1 step, as flow_grpo takes it from its scheduler."""
    sampler = FlowSDESampler(shift=shift, noise_level=a)
    state = sampler.init_state(6)
    sigmas = [float(s) for s in state.sigmas]
    assert sigmas[0] == 1.0  # so step 0 exercises the sigma_max substitution
    x, v, _ = _inputs(14)
    g = torch.Generator().manual_seed(15)
    for i in range(6):
        eps = torch.randn(x.shape, generator=g)
        step_state = state.model_copy(update={"step_index": i})
        _, nxt = sampler.step(step_state, v, x, noise=eps)
        ref_mean, ref_std = ref_mean_std(x, v, sigmas[i], sigmas[i + 1], a, sigmas[1])
        _close(nxt, ref_mean + ref_std * eps.double(), f"step {i}'s sample", **_MEAN_TOL)
        lp = sampler.log_prob(step_state, v, x, nxt)
        _close(lp, ref_log_prob(nxt, ref_mean, ref_std), f"step {i}'s log-prob", **_LOGP_TOL)
        x = nxt


# ----------------------------------------------------------------------------- the tolerance has teeth


def test_the_tolerance_is_far_below_what_a_wrong_term_moves():
    """The bugs this file is meant to catch move the output far past the tolerances, in every case with
    sigma >= 0.02: (1 - sigma) -> (1 + sigma) in the mean's v term, a std without sqrt(-dt), a log-prob
    without its -log(sqrt(2 pi)). (At sigma = 0.001 the sign flip moves the mean by std_dev_t^2 * dt * v, 5e-7 to
    9e-6 here: a few float32 ulps, inside the tolerance, so those cases guard the other terms, not this one.)"""
    x, v, _ = _inputs(10)
    for sigma, sigma_next, sigma_max, a in _CASES:
        dt = sigma_next - sigma
        s = ref_std_dev_t(sigma, a, sigma_max)
        good, _ = ref_mean_std(x, v, sigma, sigma_next, a, sigma_max)
        flipped = (x.double() * (1 + s * s / (2 * sigma) * dt)
                   + v.double() * (1 + s * s * (1 + sigma) / (2 * sigma)) * dt)
        allowed = _MEAN_TOL["atol"] + _MEAN_TOL["rtol"] * good.abs()
        if sigma >= 0.02:
            assert ((flipped - good).abs() > 10 * allowed).any(), (sigma, sigma_next, a)
        assert abs(1 / math.sqrt(-dt) - 1) > 100 * _STD_RTOL  # std off by 1/sqrt(-dt), with -dt <= 0.25 here
    assert 0.5 * math.log(2 * math.pi) > 100 * _LOGP_TOL["atol"]


def test_one_step_schedule_uses_flow_grpos_sigma_max():
    """With one inference step the schedule is [1, 0]; flow_grpo's sigma_max = sigmas[1] = 0 gives
    std_dev_t = a. fv's sampler once substituted 0.5 (std_dev_t = a * sqrt(2)) there, and grpo.py's update
    the same, so rollout and training agreed with each other but not with flow_grpo."""
    sampler = FlowSDESampler(shift=1.0, noise_level=0.7)
    state = sampler.init_state(1)
    sigmas = [float(s) for s in state.sigmas]
    assert sigmas == [1.0, 0.0]
    x, v, eps = _inputs(16)
    _, nxt = sampler.step(state, v, x, noise=eps)
    ref_mean, ref_std = ref_mean_std(x, v, sigmas[0], sigmas[1], 0.7, sigmas[1])
    _close(nxt, ref_mean + ref_std * eps.double(), "the one step's sample", **_MEAN_TOL)
