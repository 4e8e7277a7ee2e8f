"""Behaviour capture on the Wan denoise loop, through the Engine (OutputSpec.capture_behavior)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import fv_wan.loops
from fv_kernel.api import BehaviorRecord, FlowEulerSampler
from rl_helpers import engine_for, request, run, tiny_instance


@pytest.fixture(scope="module")
def instance():
    return tiny_instance()


@pytest.mark.parametrize("capture", ["final", "steps"])
def test_capture_gives_the_bit_identical_sample(instance, capture):
    plain, captured = run(engine_for(instance), [request(seed=5), request(seed=5, capture=capture)])
    assert plain.status == captured.status == "completed"
    assert plain.artifact("behavior") is None
    assert torch.equal(plain.artifact("video").frames, captured.artifact("video").frames)
    record = captured.artifact("behavior")
    assert isinstance(record, BehaviorRecord) and record.capture == capture and len(record.steps) == 3
    assert torch.equal(record.initial_noise, torch.randn(record.initial_noise.shape, generator=torch.Generator().manual_seed(5)))
    assert record.seed == 5 and record.weights_version == instance.weights_version and record.precision == "fp32"
    assert [s.step for s in record.steps] == [0, 1, 2]
    assert record.prompt == "a red fox" and record.prompt_embeds.shape[0] == 1
    assert set(record.deterministic) >= {"torch_deterministic_algorithms", "ran_alone", "stochastic_steps"}
    assert (record.steps[0].latents is not None) == (capture == "steps")


def test_capture_negative_control_a_capture_that_touches_the_latents_is_caught(instance, monkeypatch):
    """The identity check has teeth: a capture that rounds the next latents in place changes the sample."""
    real = fv_wan.loops.capture_slice

    def lossy(mode, **kw):
        kw["next_sample"].copy_(kw["next_sample"].to(torch.bfloat16).float())  # a "compressed" capture, in place
        return real(mode, **kw)

    monkeypatch.setattr(fv_wan.loops, "capture_slice", lossy)
    plain, captured = run(engine_for(instance), [request(seed=5), request(seed=5, capture="steps")])
    assert not torch.equal(plain.artifact("video").frames, captured.artifact("video").frames)


def test_steps_capture_replays_the_trajectory(instance):
    """Everything to replay: the sampler rebuilt from the record steps the captured velocities to the final latents."""
    (result,) = run(engine_for(instance), [request(seed=2, capture="steps", sampler="euler")])
    record = result.artifact("behavior")
    sampler = FlowEulerSampler(shift=3.0)
    assert record.sampler == sampler.config_signature()
    state, x = sampler.init_state(3), record.initial_noise
    assert torch.equal(state.sigmas, record.sigmas)
    for s in record.steps:
        assert torch.equal(x, s.latents)
        state, x = sampler.step(state, s.velocity, x)
    assert torch.equal(x, record.final_latents)


def test_slices_are_streamed_in_order_before_the_record(instance):
    engine = engine_for(instance)

    async def go():
        async with engine.running():
            handle = engine.submit(request(seed=1, capture="final"))
            return [e async for e in handle.events()]

    events = asyncio.run(go())
    slices = [e for e in events if e.type == "behavior.slice"]
    assert [e.slice.step for e in slices] == [0, 1, 2] and all(e.loop_id == "denoise" for e in slices)
    ready = [e.artifact.kind for e in events if e.type == "artifact.ready"]
    assert ready == ["behavior", "video"]
    assert max(e.seq for e in slices) < min(e.seq for e in events if e.type == "artifact.ready")


def test_record_saves_with_torch_and_safetensors(instance, tmp_path):
    (result,) = run(engine_for(instance), [request(seed=3, capture="steps")])
    record = result.artifact("behavior")
    record.save(tmp_path / "r.pt")
    record.save_safetensors(tmp_path / "r.safetensors")
    for loaded in (BehaviorRecord.load(tmp_path / "r.pt"), BehaviorRecord.load_safetensors(tmp_path / "r.safetensors")):
        assert loaded.model_dump(exclude={"steps", "initial_noise", "final_latents", "prompt_embeds", "sigmas", "timesteps"}) == \
            record.model_dump(exclude={"steps", "initial_noise", "final_latents", "prompt_embeds", "sigmas", "timesteps"})
        for name in ("initial_noise", "final_latents", "prompt_embeds", "sigmas", "timesteps"):
            assert torch.equal(getattr(loaded, name), getattr(record, name)), name
        for a, b in zip(loaded.steps, record.steps):
            assert torch.equal(a.latents, b.latents) and torch.equal(a.velocity, b.velocity) and a.noise is None is b.noise
    with pytest.raises(ValueError, match="not a BehaviorRecord"):
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(1)}, tmp_path / "other.safetensors")
        BehaviorRecord.load_safetensors(tmp_path / "other.safetensors")

