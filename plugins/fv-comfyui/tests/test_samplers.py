"""ComfyUI sampler × scheduler → fv sampler: the sigmas and one update against ComfyUI's formulas,
written out here independently (numpy, float32 where ComfyUI's tensors are float32)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fv_kernel.api import FlowEulerSampler
from fv_comfyui.samplers import (
    COMFY_SAMPLERS,
    SAMPLER_NAMES,
    SCHEDULER_NAMES,
    ComfyEulerNormal,
    ComfyEulerSgmUniform,
    ComfyEulerSimple,
    comfy_sigmas,
    fv_sampler_name,
)


def _shift32(shift: float, t: np.ndarray) -> np.ndarray:
    t = t.astype(np.float32)
    if shift == 1.0:
        return t
    return (np.float32(shift) * t / (np.float32(1) + np.float32(shift - 1) * t)).astype(np.float32)


def _table(shift: float) -> np.ndarray:
    # ModelSamplingDiscreteFlow: sigma((arange(1, 1001) / 1000) * 1000), float32
    ts = (np.arange(1, 1001) / np.float32(1000)).astype(np.float32) * np.float32(1000)
    return _shift32(shift, ts / np.float32(1000))


def _simple(shift: float, steps: int) -> np.ndarray:
    table = _table(shift)
    ss = len(table) / steps
    return np.array([table[-(1 + int(x * ss))] for x in range(steps)] + [0.0], dtype=np.float32)


def _normal(shift: float, steps: int, sgm: bool) -> np.ndarray:
    table = _table(shift)
    start, end = table[-1] * np.float32(1000), table[0] * np.float32(1000)
    if sgm:
        ts = torch.linspace(float(start), float(end), steps + 1)[:-1].numpy()
    else:
        ts = torch.linspace(float(start), float(end), steps).numpy()
    return np.array([*_shift32(shift, ts / np.float32(1000)), 0.0], dtype=np.float32)


@pytest.mark.parametrize("shift", [1.0, 3.0, 8.0, 8.000000000000002, 12.0])
@pytest.mark.parametrize("steps", [1, 4, 7, 20, 30])
def test_sigmas_are_comfyuis(shift: float, steps: int) -> None:
    assert np.array_equal(comfy_sigmas("simple", shift, steps).numpy(), _simple(shift, steps))
    assert np.allclose(comfy_sigmas("normal", shift, steps).numpy(), _normal(shift, steps, sgm=False), rtol=0, atol=1e-6)
    assert np.allclose(comfy_sigmas("sgm_uniform", shift, steps).numpy(), _normal(shift, steps, sgm=True), rtol=0, atol=1e-6)


def test_known_values() -> None:
    sig = comfy_sigmas("simple", 8.0, 20).numpy()
    assert sig[0] == 1.0 and sig[-1] == 0.0 and len(sig) == 21
    # x = 10: table index 1000 - 1 - 500 -> t = 0.5 -> 8 * 0.5 / (1 + 7 * 0.5)
    assert math.isclose(float(sig[10]), 4.0 / 4.5, rel_tol=1e-6)
    normal = comfy_sigmas("normal", 1.0, 3).numpy()  # linspace(1000, 1, 3) / 1000
    assert np.allclose(normal, [1.0, 0.5005, 0.001, 0.0], atol=1e-6)


@pytest.mark.parametrize("cls", [c for c in COMFY_SAMPLERS if c.name.startswith("comfy-euler-")])
def test_one_euler_update_is_k_diffusions(cls: type) -> None:
    sampler = cls(shift=5.0)
    state = sampler.init_state(6)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 2, 3, 3, generator=gen)
    v = torch.randn(x.shape, generator=gen)
    sigmas = comfy_sigmas(cls.scheduler, 5.0, 6)
    assert torch.equal(state.sigmas, sigmas)
    assert torch.allclose(sampler.timestep(state), sigmas[0] * 1000)
    state1, x1 = sampler.step(state, v, x)
    s, s_next = sigmas[0], sigmas[1]
    denoised = x - v * s  # CONST.calculate_denoised
    expected = x + ((x - denoised) / s) * (s_next - s)  # sample_euler, s_churn = 0
    assert torch.equal(x1, expected)
    assert state1.step_index == 1
    # flow Euler written the usual way agrees to rounding, not bit for bit: the mapping keeps ComfyUI's order
    assert torch.allclose(x1, x + v * (s_next - s), atol=1e-5)


def test_fvs_own_euler_is_not_comfyuis_simple() -> None:
    # Negative control: the kernel's euler (diffusers' schedule) is a different schedule, so
    # mapping ComfyUI's euler to it would silently change the result.
    ours = FlowEulerSampler(shift=8.0).init_state(20).sigmas
    assert not torch.allclose(ours, comfy_sigmas("simple", 8.0, 20), atol=1e-4)


def test_mapping_and_refusals() -> None:
    assert SAMPLER_NAMES == ("euler", "uni_pc", "uni_pc_bh2") and set(SCHEDULER_NAMES) == {"simple", "normal", "sgm_uniform"}
    assert fv_sampler_name("euler", "simple") == ComfyEulerSimple.name
    assert fv_sampler_name("euler", "normal") == ComfyEulerNormal.name
    assert fv_sampler_name("euler", "sgm_uniform") == ComfyEulerSgmUniform.name
    # every pair names a registered class that runs that ComfyUI sampler and scheduler
    by_name = {cls.name: cls for cls in COMFY_SAMPLERS}
    assert len(by_name) == len(SAMPLER_NAMES) * len(SCHEDULER_NAMES)
    for sampler_name in SAMPLER_NAMES:
        for scheduler in SCHEDULER_NAMES:
            cls = by_name[fv_sampler_name(sampler_name, scheduler)]
            assert cls.scheduler == scheduler
            assert getattr(cls, "variant", None) == {"euler": None, "uni_pc": "bh1", "uni_pc_bh2": "bh2"}[sampler_name]
    for sampler_name, scheduler in [("uni_pc", "karras"), ("euler", "karras"), ("dpmpp_2m", "normal"), ("euler", "beta")]:
        with pytest.raises(ValueError, match="no fv sampler computes ComfyUI's"):
            fv_sampler_name(sampler_name, scheduler)
    with pytest.raises(ValueError, match="scheduler 'karras' is not one fv runs"):
        comfy_sigmas("karras", 8.0, 20)


def test_state_round_trips_through_its_signature() -> None:
    from fv_kernel.api import SamplerState

    sampler = ComfyEulerSimple(shift=8.0)
    state = sampler.init_state(4)
    restored = SamplerState.from_bytes(state.to_bytes())
    assert restored.sampler == state.sampler and torch.equal(restored.sigmas, state.sigmas)
