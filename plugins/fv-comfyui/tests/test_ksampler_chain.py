"""The two-stage ``KSamplerAdvanced`` chain (Wan 2.2 A14B) as one fv run with a stage restart.

ComfyUI runs each ``KSamplerAdvanced`` node as its own ``KSampler.sample`` call (``nodes.py``
``common_ksampler``; ``comfy/samplers.py``): both nodes compute the schedule for ``steps``
(``KSampler.calculate_sigmas``), the first samples ``sigmas[:end_at_step + 1]`` from the noise
and returns its result through CONST's ``inverse_noise_scaling`` (``x / (1 - sigma)``), the
second samples ``sigmas[start_at_step:]`` from that latent with no noise (``noise_scaling``:
``sigma * 0 + (1 - sigma) * latent``). A multistep sampler therefore starts afresh in the second
call. The reference below writes those two calls out (the samplers themselves as in
``test_unipc.py``, written independently of fv's); the fv sampler is driven as fv's denoise loop
drives it, once, with the switch step in its state's ``stage_starts``.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest
import torch

from test_unipc import REVISIONS, comfy_uni_pc, const_denoiser, initial_noise, node_sigmas, velocity
import fv_comfyui.samplers as comfy_samplers
from fv_comfyui.samplers import ComfyEulerSimple, ComfyUniPCBh2Simple, ComfyUniPCSimple, ComfyUniPCState, comfy_sigmas

SAMPLERS = {"euler": ComfyEulerSimple, "uni_pc": ComfyUniPCSimple, "uni_pc_bh2": ComfyUniPCBh2Simple}


def comfy_euler(denoiser: Callable[..., torch.Tensor], noise: torch.Tensor, sigmas: torch.Tensor,
                latent: torch.Tensor) -> torch.Tensor:
    """One KSAMPLER call with k-diffusion's ``sample_euler`` (no churn) on a CONST model."""
    x = sigmas[0] * noise + (1.0 - sigmas[0]) * latent  # CONST.noise_scaling
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i].expand(x.shape[0]))
        d = (x - denoised) / sigmas[i]  # to_d
        x = x + d * (sigmas[i + 1] - sigmas[i])
    return x / (1.0 - sigmas[-1])  # CONST.inverse_noise_scaling


def comfy_chain(sampler_name: str, noise: torch.Tensor, steps: int, switch: int,
                denoiser: Callable[..., torch.Tensor] = const_denoiser,
                latent_format: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Two KSamplerAdvanced nodes: add_noise enable 0→switch (leftover noise kept), then add_noise
    disable switch→10000. ``latent_format``: (mean, std) of the model's latent format, whose
    ``process_latent_out`` / ``process_latent_in`` ComfyUI applies between the nodes."""
    if sampler_name == "euler":
        sigmas = comfy_sigmas("simple", SHIFT, steps)
    else:
        sigmas = node_sigmas("simple", SHIFT, steps)  # the uni_pc schedule: steps + 1, next-to-last dropped

    def call(noise_in: torch.Tensor, part: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        if sampler_name == "euler":
            return comfy_euler(denoiser, noise_in, part, latent)
        variant = "bh1" if sampler_name == "uni_pc" else "bh2"
        return comfy_uni_pc(denoiser, noise_in, part, variant, revision="0748e38", latent=latent)

    first = call(noise, sigmas[: switch + 1], torch.zeros_like(noise))
    if latent_format is not None:
        mean, std = latent_format
        first = (first * std + mean - mean) / std  # process_latent_out, then process_latent_in
    return call(torch.zeros_like(noise), sigmas[switch:], first)


SHIFT = 8.0


def run_fv(sampler: Any, noise: torch.Tensor, steps: int, stage_starts: tuple[int, ...],
           calls: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    state = sampler.init_state(steps).model_copy(update={"stage_starts": stage_starts})
    x = noise.clone()
    while not sampler.is_done(state):
        sigma = state.sigmas[state.step_index].reshape(1)
        if calls is not None:
            calls.append((x.clone(), sigma.clone()))
        state, x = sampler.step(state, velocity(x, sigma), x)
    return x


def recording(calls: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., torch.Tensor]:
    def denoiser(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        calls.append((x.clone(), sigma.reshape(-1)[:1].clone()))
        return const_denoiser(x, sigma)

    return denoiser


CASES = [(steps, switch) for steps in (2, 4, 6, 9) for switch in range(1, steps)]


@pytest.mark.parametrize("sampler_name", list(SAMPLERS))
@pytest.mark.parametrize(("steps", "switch"), CASES)
def test_chain_is_comfyuis_two_calls_bit_for_bit(sampler_name: str, steps: int, switch: int) -> None:
    cls = SAMPLERS[sampler_name]
    sampler = cls(shift=SHIFT)
    sigmas = sampler.init_state(steps).sigmas
    noise = initial_noise(steps * 10 + switch, sigmas[0])
    comfy_calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    fv_calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    expected = comfy_chain(sampler_name, noise, steps, switch, recording(comfy_calls))
    got = run_fv(sampler, noise, steps, (switch,), fv_calls)
    assert len(fv_calls) == len(comfy_calls) == steps  # one model call per step in both
    for i, ((x_fv, s_fv), (x_comfy, s_comfy)) in enumerate(zip(fv_calls, comfy_calls)):
        assert torch.equal(s_fv, s_comfy), (i, s_fv, s_comfy)
        assert torch.equal(x_fv, x_comfy), f"model input {i}: max abs diff {(x_fv - x_comfy).abs().max().item():.3g}"
    assert torch.equal(got, expected), f"max abs diff {(got - expected).abs().max().item():.3g}"


def _no_stages(state: Any, index: int) -> tuple[int, int]:
    return 0, state.num_steps


@pytest.mark.parametrize("sampler_name", list(SAMPLERS))
def test_negative_control_without_the_restart_it_is_not_comfyuis(sampler_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The stage split taken away (one sampler call across the switch, as fv ran the chain before):
    # the bit-for-bit test above fails. For UniPC by far (its history and orders carry across).
    steps, switch = 6, 4
    sampler = SAMPLERS[sampler_name](shift=SHIFT)
    noise = initial_noise(3, sampler.init_state(steps).sigmas[0])
    expected = comfy_chain(sampler_name, noise, steps, switch)
    assert torch.equal(run_fv(sampler, noise, steps, (switch,)), expected)
    monkeypatch.setattr(comfy_samplers, "stage_bounds", _no_stages)
    unsplit = run_fv(sampler, noise, steps, (switch,))
    assert not torch.equal(unsplit, expected)
    if sampler_name != "euler":  # euler differs only by the hand-off's rounding
        assert (unsplit - expected).abs().max().item() > 1e-3


def test_the_switch_is_not_the_whole_run_in_one_call() -> None:
    # Negative control for the reference: a chain is not one KSampler over every step.
    steps, switch = 6, 3
    sigmas = node_sigmas("simple", SHIFT, steps)
    noise = initial_noise(5, sigmas[0])
    whole = comfy_uni_pc(const_denoiser, noise, sigmas, "bh1", revision="0748e38")
    assert (comfy_chain("uni_pc", noise, steps, switch) - whole).abs().max().item() > 1e-3
    assert torch.equal(run_fv(ComfyUniPCSimple(shift=SHIFT), noise, steps, ()), whole)


@pytest.mark.parametrize("revision", list(REVISIONS))
def test_both_revisions_restart_the_same_way(revision: str) -> None:
    steps, switch = 8, 5
    sampler = ComfyUniPCSimple(shift=SHIFT, b_dtype=REVISIONS[revision])
    noise = initial_noise(7, sampler.init_state(steps).sigmas[0])
    sigmas = node_sigmas("simple", SHIFT, steps)
    first = comfy_uni_pc(const_denoiser, noise, sigmas[: switch + 1], "bh1", revision=revision)
    zeros = torch.zeros_like(noise)
    expected = comfy_uni_pc(const_denoiser, zeros, sigmas[switch:], "bh1", revision=revision, latent=first)
    assert torch.equal(run_fv(sampler, noise, steps, (switch,)), expected)


def test_comfyuis_latent_format_round_trip_between_the_nodes_is_rounding_only() -> None:
    # ComfyUI's process_latent_out / process_latent_in between the nodes (Wan 2.1's per-channel
    # mean and std) is not repeated by fv: measured, it moves the result by float rounding.
    mean = torch.tensor([-0.7571, -0.7089, -0.9113, 0.1075]).view(1, 4, 1, 1, 1)
    std = torch.tensor([2.8184, 1.4541, 2.3275, 2.6558]).view(1, 4, 1, 1, 1)
    worst = 0.0
    for sampler_name, cls in SAMPLERS.items():
        for steps, switch in ((4, 2), (9, 6)):
            noise = initial_noise(steps + switch, cls(shift=SHIFT).init_state(steps).sigmas[0])
            got = run_fv(cls(shift=SHIFT), noise, steps, (switch,))
            expected = comfy_chain(sampler_name, noise, steps, switch, latent_format=(mean, std))
            worst = max(worst, (got - expected).abs().max().item())
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("cls", [ComfyUniPCSimple, ComfyEulerSimple])
def test_a_state_saved_at_the_switch_resumes_bit_identically(cls: Any) -> None:
    steps, switch = 6, 3
    sampler = cls(shift=SHIFT)
    noise = initial_noise(9, sampler.init_state(steps).sigmas[0])
    state, x = sampler.init_state(steps).model_copy(update={"stage_starts": (switch,)}), noise.clone()
    while state.step_index < switch:
        state, x = sampler.step(state, velocity(x, state.sigmas[state.step_index].reshape(1)), x)
    restored = cls.state_type.from_bytes(state.to_bytes())
    assert restored.stage_starts == (switch,)
    if isinstance(restored, ComfyUniPCState):  # the fresh stage: no history, its start kept exactly
        assert restored.history == [] and torch.equal(restored.base, state.base)
    while not sampler.is_done(restored):
        restored, x = sampler.step(restored, velocity(x, restored.sigmas[restored.step_index].reshape(1)), x)
    assert torch.equal(x, run_fv(sampler, noise, steps, (switch,)))


# --------------------------------------------------------------------------- the fixtures, compiled and run

FIXTURES = Path(__file__).parent / "fixtures"


def _fixture(sampler_name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"ksampler_chain_{sampler_name}.api.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("sampler_name", ["euler", "uni_pc"])
def test_fixture_chain_compiles_to_the_installed_card_with_its_switch_step(service: Any, sampler_name: str) -> None:
    answer = service.check(_fixture(sampler_name))
    assert answer.ok, answer.body()
    (job,) = answer.jobs
    assert job.card is service.cards["wan-tiny-a14b"]
    assert {k: job.options[k] for k in ("steps", "guidance", "guidance_2", "switch_step", "shift", "sampler", "seed")} == {
        "steps": 6, "guidance": 4.0, "guidance_2": 3.0, "switch_step": 2, "shift": 8.0,
        "sampler": f"comfy-{sampler_name}-simple", "seed": 42}
    # Not the card's own switch: its boundary puts the second expert elsewhere on this schedule.
    sampler = SAMPLERS[sampler_name](shift=8.0)
    boundary = job.card.loops["denoise"].config["boundary_ratio"] * 1000.0
    own = next(i for i, t in enumerate(sampler.init_state(6).timesteps.tolist()) if t < boundary)
    assert own == 4


def test_fixture_chain_runs_with_the_restart_in_the_denoise_loop(service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from fv_comfyui.run import JobRunner

    (job,) = service.check(_fixture("uni_pc")).jobs
    video = JobRunner().run(job)
    assert video.frames.shape == (5, 3, 32, 32) and video.frames.std() > 0.01
    # Negative control: the same run without the restart (one UniPC history across the switch) differs.
    monkeypatch.setattr(comfy_samplers, "stage_bounds", _no_stages)
    unsplit = JobRunner().run(job)
    assert (unsplit.frames - video.frames).abs().max().item() > 1e-3


@pytest.mark.parametrize("sampler_name", ["euler", "uni_pc"])
def test_served_comfyui_route_accepts_and_runs_the_chain(host: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         sampler_name: str) -> None:
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from conftest import MODELS_FILE
    from fv_kernel.api import DeployConfig, Engine, InstanceOptions, PluginsConfig, SchedulerConfig, build_instance
    from fv_comfyui.serving import mount
    from fv_comfyui.settings import MODELS_ENV
    from fv_wan.cards import wan_cards

    monkeypatch.delenv(MODELS_ENV, raising=False)
    deploy = DeployConfig(output_dir=tmp_path, plugins=PluginsConfig(settings={"fv-comfyui": {"models": str(MODELS_FILE)}}))
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny-a14b")
    engine.add_instance(build_instance(card, InstanceOptions(registry=host.registry())))  # with fv-comfyui's samplers

    @contextlib.asynccontextmanager
    async def running(_: FastAPI) -> AsyncIterator[None]:
        async with engine.running():
            yield

    app = FastAPI(lifespan=running)
    mount(app, engine, deploy)  # the routes fv serve mounts (fv_serving_routes), over the served card as it is
    with TestClient(app) as client:
        response = client.post("/prompt", json={"prompt": _fixture(sampler_name)})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["node_errors"] == {}
        for _ in range(600):
            history = client.get(f"/history/{body['prompt_id']}").json()
            if history:
                break
            time.sleep(0.1)
        entry = history[body["prompt_id"]]
        assert entry["status"]["status_str"] == "success", entry["status"]
        assert set(entry["outputs"]) == {"28", "47"}


def test_chains_fv_does_not_run_are_refused_saying_why(service: Any) -> None:
    # end_at_step 0: ComfyUI's first call then samples one sigma and divides by 1 - sigma_0 = 0.
    prompt = _fixture("uni_pc")
    prompt["57"]["inputs"]["end_at_step"] = prompt["58"]["inputs"]["start_at_step"] = 0
    answer = service.check(prompt)
    assert not answer.ok and "inside 1..5" in answer.node_errors["58"]["errors"][0]["details"]
    # Three stages: the middle one adds no noise, so the last one's first stage is not a first stage.
    prompt = _fixture("uni_pc")
    prompt["59"] = json.loads(json.dumps(prompt["58"]))
    prompt["59"]["inputs"].update(start_at_step=4, latent_image=["58", 0])
    prompt["58"]["inputs"].update(end_at_step=4, return_with_leftover_noise="enable")
    prompt["8"]["inputs"]["samples"] = ["59", 0]
    answer = service.check(prompt)
    assert not answer.ok and "must add noise" in answer.node_errors["58"]["errors"][0]["details"]
    # Negative control: the fixture itself is accepted.
    assert service.check(_fixture("uni_pc")).ok
