"""Flow-GRPO's SDE sampler: a = 0 is the Euler step, the density, Fast windows."""

from __future__ import annotations

import pytest
import torch

from fv_kernel.api import FlowEulerSampler, SamplerError
from fv_rl.sde import FlowSDESampler, gaussian_log_prob, sde_mean_std


def _tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 3, 5, 5, generator=g) for _ in range(3)]


def test_noise_level_zero_is_the_euler_step_bit_for_bit():
    x, v, _ = _tensors()
    sde, euler = FlowSDESampler(shift=3.0, noise_level=0.0), FlowEulerSampler(shift=3.0)
    s_state, e_state = sde.init_state(5), euler.init_state(5)
    assert torch.equal(s_state.sigmas, e_state.sigmas)
    for _ in range(5):
        assert not sde.needs_noise(s_state)
        s_state, xs = sde.step(s_state, v, x)
        e_state, xe = euler.step(e_state, v, x)
        assert torch.equal(xs, xe)
        x = xe


def test_the_sde_mean_with_zero_noise_level_is_the_euler_update():
    x, v, _ = _tensors(1)
    mean, std = sde_mean_std(x, v, 0.8, 0.6, 0.0, 0.9)
    assert torch.equal(std, torch.zeros(())) or float(std) == 0.0
    torch.testing.assert_close(mean, x + (0.6 - 0.8) * v, rtol=0, atol=1e-6)
    # negative control: a > 0 moves the mean off the Euler update
    mean_sde, _ = sde_mean_std(x, v, 0.8, 0.6, 0.7, 0.9)
    assert (mean_sde - (x + (0.6 - 0.8) * v)).abs().max() > 1e-3


def test_sde_step_draws_from_its_gaussian_and_log_prob_is_its_density():
    x, v, eps = _tensors(2)
    sampler = FlowSDESampler(shift=3.0, noise_level=0.7)
    state = sampler.init_state(4)
    state = state.model_copy(update={"step_index": 1})
    assert sampler.needs_noise(state)
    _, nxt = sampler.step(state, v, x, noise=eps)
    mean, std = sde_mean_std(x, v, state.sigmas[1], state.sigmas[2], 0.7, float(state.sigmas[1]))
    torch.testing.assert_close(nxt, mean + std * eps)
    lp = sampler.log_prob(state, v, x, nxt)
    expected = torch.distributions.Normal(mean, std).log_prob(nxt).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(lp, expected, rtol=1e-5, atol=1e-5)
    # the density is highest at the mean: a sample moved away scores lower
    assert (sampler.log_prob(state, v, x, nxt + 3 * std) < lp).all()


def test_first_step_at_sigma_one_is_finite():
    x, v, eps = _tensors(3)
    sampler = FlowSDESampler(shift=1.0, noise_level=0.7)
    state = sampler.init_state(4)
    assert float(state.sigmas[0]) == 1.0
    _, nxt = sampler.step(state, v, x, noise=eps)
    assert torch.isfinite(nxt).all() and torch.isfinite(sampler.log_prob(state, v, x, nxt)).all()


def test_fast_window_makes_only_those_steps_stochastic():
    sampler = FlowSDESampler(shift=3.0, sde_window=(1, 3))
    state = sampler.init_state(5)
    flags = [sampler.needs_noise(state.model_copy(update={"step_index": i})) for i in range(5)]
    assert flags == [False, True, True, False, False]
    x, v, _ = _tensors(4)
    with pytest.raises(SamplerError, match="ODE step"):
        sampler.log_prob(state, v, x, x)
    with pytest.raises(ValueError, match="sde_window"):
        FlowSDESampler(sde_window=(3, 3))


def test_gaussian_log_prob_has_gradient_in_the_mean():
    x, v, _ = _tensors(5)
    v = v.requires_grad_(True)
    mean, std = sde_mean_std(x, v, 0.7, 0.5, 0.7, 0.9)
    gaussian_log_prob(x, mean, std).sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
