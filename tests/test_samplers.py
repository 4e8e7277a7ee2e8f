"""Samplers vs diffusers, step by step, plus DMD, state round trips and config validation.

Euler and UniPC are checked for *bit* equality with diffusers' schedulers (sigmas,
timesteps incl. dtype, and every step's output) on the same random model outputs. The
implementation evaluates the same float32/float64 operations in the same order, so no
tolerance is needed; a failure here means the math or its rounding path diverged.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from pydantic import ValidationError

from fv_kernel.loop.samplers import (
    DMDSampler,
    FlowEulerSampler,
    FlowUniPCSampler,
    Sampler,
    SamplerError,
    SamplerState,
    UniPCState,
    add_noise,
    builtin_samplers,
    shift_sigmas,
)

SHAPE = (2, 3, 2, 4, 4)


def _diffusers_unipc(shift: float, **kwargs) -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=shift, **kwargs
    )


def _compare_trajectory(
    reference, sampler: Sampler, steps: int, *, dtype: torch.dtype = torch.float32, reference_nan_last: bool = False
) -> None:
    reference.set_timesteps(steps)
    state = sampler.init_state(steps)
    assert torch.equal(state.sigmas, reference.sigmas)
    assert state.sigmas[-1] == 0 and state.sigmas.shape == (steps + 1,)
    assert state.timesteps.dtype == reference.timesteps.dtype
    assert torch.equal(state.timesteps, reference.timesteps)

    generator = torch.Generator().manual_seed(1000 * steps + 7)
    ours = theirs = torch.randn(SHAPE, generator=generator).to(dtype)
    for index, t in enumerate(reference.timesteps):
        assert not sampler.is_done(state)
        assert state.step_index == index
        assert torch.equal(sampler.timestep(state), t)
        assert sampler.sigma(state) == float(reference.sigmas[index])
        assert not sampler.needs_noise(state)
        model_output = torch.randn(SHAPE, generator=generator).to(dtype)
        theirs = reference.step(model_output, t, theirs).prev_sample
        state, ours = sampler.step(state, model_output, ours)
        assert ours.dtype == theirs.dtype
        if reference_nan_last and index == steps - 1:
            # diffusers' bh1 computes B_h*0 with B_h = -inf at sigma=0 and returns NaN; the
            # limit (and our output) is the last x0 prediction.
            assert torch.isnan(theirs).all() and torch.isfinite(ours).all()
            assert torch.equal(ours, state.model_outputs[-1])
            break
        assert torch.equal(ours, theirs), f"step {index}: max abs diff {(ours - theirs).abs().max().item()}"
    assert sampler.is_done(state)


@pytest.mark.parametrize("steps", [1, 2, 3, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 8.0])
def test_euler_matches_diffusers(steps: int, shift: float) -> None:
    _compare_trajectory(FlowMatchEulerDiscreteScheduler(shift=shift), FlowEulerSampler(shift=shift), steps)


@pytest.mark.parametrize("steps", [1, 2, 3, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 8.0])
def test_unipc_matches_diffusers(steps: int, shift: float) -> None:
    _compare_trajectory(_diffusers_unipc(shift), FlowUniPCSampler(shift=shift), steps)


@pytest.mark.parametrize(
    "options",
    [
        {"solver_order": 1},
        {"solver_order": 3},
        {"solver_type": "bh1"},
        {"solver_order": 3, "solver_type": "bh1"},
        {"disable_corrector": (0, 2)},
    ],
)
@pytest.mark.parametrize("steps", [2, 4, 12])
def test_unipc_solver_options_match_diffusers(options: dict, steps: int) -> None:
    theirs = _diffusers_unipc(5.0, **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()})
    bh1 = options.get("solver_type") == "bh1"
    _compare_trajectory(theirs, FlowUniPCSampler(shift=5.0, **options), steps, reference_nan_last=bh1)


def test_bf16_model_outputs_follow_diffusers_dtype_path() -> None:
    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    _compare_trajectory(euler, FlowEulerSampler(shift=3.0), 6, dtype=torch.bfloat16)
    _compare_trajectory(_diffusers_unipc(3.0), FlowUniPCSampler(shift=3.0), 6, dtype=torch.bfloat16)


def test_euler_schedule_shifts_the_shifted_endpoint_again() -> None:
    # The grid runs to shift(1/T) and is then shifted again: last sigma = shift(shift(1/T)).
    state = FlowEulerSampler(shift=5.0).init_state(4)
    once = shift_sigmas(torch.tensor(0.001, dtype=torch.float64), 5.0)
    twice = float(shift_sigmas(once, 5.0))
    assert float(state.sigmas[-2]) == pytest.approx(twice, rel=1e-6)
    assert float(state.sigmas[-2]) != pytest.approx(float(once), rel=1e-3)


# --------------------------------------------------------------------------- DMD


def _dmd_reference(sigmas: list[float], outputs, x, noises) -> torch.Tensor:
    """The FastWan loop written out: x0 = x - s*v; re-noise with fresh noise unless last."""
    for i, (sigma, v) in enumerate(zip(sigmas, outputs)):
        x0 = x - sigma * v
        x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * noises[i] if i + 1 < len(outputs) else x0
    return x


@pytest.mark.parametrize("scheduler_space", [True, False])
def test_dmd_matches_hand_written_loop(scheduler_space: bool) -> None:
    sampler = DMDSampler(timesteps_are_scheduler_space=scheduler_space)
    state = sampler.init_state(3)
    labels = torch.tensor([1000.0, 757.0, 522.0]) / 1000
    expected = labels if scheduler_space else 8.0 * labels / (1 + 7.0 * labels)
    assert torch.equal(state.sigmas, torch.cat([expected, torch.zeros(1)]))
    assert torch.equal(state.timesteps, expected * 1000)
    if scheduler_space:
        torch.testing.assert_close(state.timesteps, torch.tensor([1000.0, 757.0, 522.0]))

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, generator=generator)
    outputs = [torch.randn(SHAPE, generator=generator) for _ in range(3)]
    noises = [torch.randn(SHAPE, generator=generator) for _ in range(2)]
    sigmas = [state.sigmas[i] for i in range(4)]

    ours, used = x, 0
    for v in outputs:
        noise = None
        if sampler.needs_noise(state):
            noise, used = noises[used], used + 1
        state, ours = sampler.step(state, v, ours, noise=noise)
    assert used == 2 and sampler.is_done(state)
    assert torch.equal(ours, _dmd_reference(sigmas, outputs, x, noises))


def test_dmd_ode_mode_reuses_implied_noise_and_draws_none() -> None:
    sampler = DMDSampler(sample_type="ode", denoising_timesteps=(1000, 750, 500, 250))
    state = sampler.init_state(4)
    generator = torch.Generator().manual_seed(5)
    x0_true, eps = torch.randn(SHAPE, generator=generator), torch.randn(SHAPE, generator=generator)
    x = add_noise(x0_true, eps, state.sigmas[0])
    while not sampler.is_done(state):
        assert not sampler.needs_noise(state)
        # The exact velocity of a straight path keeps the trajectory on it.
        state, x = sampler.step(state, eps - x0_true, x)
    torch.testing.assert_close(x, x0_true, atol=1e-5, rtol=0)


def test_dmd_noise_contract() -> None:
    sampler = DMDSampler()
    state = sampler.init_state(3)
    x = torch.zeros(SHAPE)
    with pytest.raises(SamplerError, match="needs fresh noise"):
        sampler.step(state, x, x)
    with pytest.raises(SamplerError, match="noise shape"):
        sampler.step(state, x, x, noise=torch.zeros(2, 3))
    state, x = sampler.step(state, x, x, noise=torch.zeros(SHAPE))
    state, x = sampler.step(state, x, x, noise=torch.zeros(SHAPE))
    assert not sampler.needs_noise(state)  # last step outputs x0
    with pytest.raises(SamplerError, match="takes no noise"):
        sampler.step(state, x, x, noise=torch.zeros(SHAPE))
    with pytest.raises(SamplerError, match="exactly 3 steps"):
        sampler.init_state(4)


def test_euler_and_unipc_reject_noise() -> None:
    for sampler in (FlowEulerSampler(shift=3.0), FlowUniPCSampler(shift=3.0)):
        state = sampler.init_state(2)
        with pytest.raises(SamplerError, match="takes no noise"):
            sampler.step(state, torch.zeros(SHAPE), torch.zeros(SHAPE), noise=torch.zeros(SHAPE))


def test_add_noise_per_sample_sigma() -> None:
    x0, noise = torch.ones(2, 3), torch.full((2, 3), 3.0)
    out = add_noise(x0, noise, torch.tensor([0.0, 0.5]))
    assert torch.equal(out, torch.tensor([[1.0] * 3, [2.0] * 3]))
    with pytest.raises(SamplerError, match="per-sample sigma"):
        add_noise(x0, noise, torch.tensor([0.1, 0.2, 0.3]))


# --------------------------------------------------------------------------- state


def _run(sampler: Sampler, state: SamplerState, sample, outputs, noises):
    for v in outputs:
        noise = noises.pop(0) if sampler.needs_noise(state) else None
        state, sample = sampler.step(state, v, sample, noise=noise)
    return state, sample


@pytest.mark.parametrize(
    "sampler",
    [
        FlowUniPCSampler(shift=5.0, solver_order=3),
        FlowEulerSampler(shift=3.0),
        DMDSampler(denoising_timesteps=(1000, 800, 600, 400, 200)),
    ],
    ids=["unipc3", "euler", "dmd"],
)
def test_state_round_trip_resumes_bit_identically(sampler: Sampler) -> None:
    steps, cut = 5, 3
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(SHAPE, generator=generator)
    outputs = [torch.randn(SHAPE, generator=generator) for _ in range(steps)]
    noises = [torch.randn(SHAPE, generator=generator) for _ in range(steps)]

    straight_state, straight = _run(sampler, sampler.init_state(steps), x, outputs, list(noises))

    mid_state, mid = _run(sampler, sampler.init_state(steps), x, outputs[:cut], list(noises))
    saved = mid_state.to_bytes()
    restored = sampler.state_type.from_bytes(saved)
    assert type(restored) is type(mid_state)
    for name in type(mid_state).model_fields:
        a, b = getattr(mid_state, name), getattr(restored, name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.dtype == b.dtype
        elif isinstance(a, list):
            assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
        else:
            assert a == b
    fresh = sampler.init_state(steps)
    used = sum(sampler.needs_noise(fresh.model_copy(update={"step_index": i})) for i in range(cut))
    resumed_state, resumed = _run(sampler, restored, mid, outputs[cut:], list(noises[used:]))
    assert torch.equal(resumed, straight)
    assert resumed_state.step_index == straight_state.step_index == steps


def test_step_does_not_mutate_input_state() -> None:
    sampler = FlowUniPCSampler(shift=3.0, solver_order=3)
    generator = torch.Generator().manual_seed(2)
    state, x = sampler.init_state(6), torch.randn(SHAPE, generator=generator)
    for _ in range(3):
        state, x = sampler.step(state, torch.randn(SHAPE, generator=generator), x)
    before = state.model_copy(deep=True)
    v = torch.randn(SHAPE, generator=generator)
    first_state, first = sampler.step(state, v, x)
    assert state.step_index == before.step_index and state.this_order == before.this_order
    assert torch.equal(state.last_sample, before.last_sample)
    assert all(torch.equal(a, b) for a, b in zip(state.model_outputs, before.model_outputs))
    assert len(state.model_outputs) == len(before.model_outputs)
    # Stepping the same state twice is deterministic: the state is a value.
    second_state, second = sampler.step(state, v, x)
    assert torch.equal(first, second) and first_state.step_index == second_state.step_index == 4


def test_state_is_bound_to_its_sampler_config() -> None:
    state = FlowUniPCSampler(shift=3.0).init_state(4)
    x = torch.zeros(SHAPE)
    with pytest.raises(SamplerError, match="belongs to sampler"):
        FlowUniPCSampler(shift=5.0).step(state, x, x)
    with pytest.raises(SamplerError, match="needs a UniPCState"):
        FlowUniPCSampler(shift=3.0).step(FlowEulerSampler(shift=3.0).init_state(4), x, x)
    with pytest.raises(SamplerError, match="model_output shape"):
        FlowUniPCSampler(shift=3.0).step(state, torch.zeros(2, 2), x)
    done = state.model_copy(update={"step_index": 4})
    with pytest.raises(SamplerError, match="trajectory is done"):
        FlowUniPCSampler(shift=3.0).step(done, x, x)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (FlowEulerSampler, {"shift": 0.0}, "shift"),
        (FlowEulerSampler, {"shift": -1.0}, "shift"),
        (FlowEulerSampler, {"shift": float("nan")}, "shift"),
        (FlowEulerSampler, {"shfit": 3.0}, "shfit"),
        (FlowUniPCSampler, {"solver_order": 4}, "solver_order"),
        (FlowUniPCSampler, {"solver_type": "midpoint"}, "solver_type"),
        (FlowUniPCSampler, {"lower_order_final": False}, "lower_order_final"),
        (FlowUniPCSampler, {"num_train_timesteps": 0}, "num_train_timesteps"),
        (DMDSampler, {"denoising_timesteps": (500, 757)}, "strictly decreasing"),
        (DMDSampler, {"denoising_timesteps": (1200, 500)}, "(0, 1000]"),
        (DMDSampler, {"denoising_timesteps": ()}, "must not be empty"),
        (DMDSampler, {"sample_type": "euler"}, "sample_type"),
    ],
)
def test_config_validation(cls: type[Sampler], kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field.replace("(", r"\(").replace("[", r"\[").replace("]", r"\]")):
        cls(**kwargs)


@pytest.mark.parametrize("steps", [0, -1, 2.0, True])
def test_bad_step_count(steps) -> None:
    with pytest.raises(SamplerError, match="num_inference_steps"):
        FlowEulerSampler(shift=3.0).init_state(steps)


def test_configs_are_frozen_and_signatures_stable() -> None:
    sampler = FlowUniPCSampler(shift=3.0)
    with pytest.raises(ValidationError):
        sampler.shift = 5.0  # type: ignore[misc]
    assert sampler.config_signature() == FlowUniPCSampler(shift=3.0).config_signature()
    assert sampler.config_signature() != FlowUniPCSampler(shift=5.0).config_signature()
    assert sampler.config_signature().startswith("unipc:")
    assert DMDSampler().config_signature() != DMDSampler(timesteps_are_scheduler_space=False).config_signature()


def test_builtin_samplers() -> None:
    names = builtin_samplers()
    assert names == {"euler": FlowEulerSampler, "unipc": FlowUniPCSampler, "dmd": DMDSampler}
    assert all(issubclass(cls, Sampler) for cls in names.values())
    names.clear()  # a fresh dict each call, no shared registry
    assert len(builtin_samplers()) == 3
    assert FlowUniPCSampler.state_type is UniPCState and FlowEulerSampler.state_type is SamplerState
