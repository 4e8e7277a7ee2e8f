"""C2 parity (design §9.2): the rollout forward (no_grad, through the Engine) equals the training
forward (with grad) on the captured quantity -- per-step log-probs for Flow-GRPO, the seeded
final sample and the prediction-space velocity for DiffusionNFT."""

from __future__ import annotations

import copy

import pytest
import torch

from fv_rl.grpo import FlowGRPO, GRPOOptions, rollout_card, sde_sampler_of
from fv_rl.online import as_input
from fv_rl.sde import gaussian_log_prob, sde_mean_std
from rl_helpers import engine_for, host, request, run, tiny_instance
from fv_kernel.api import CardCatalog


@pytest.fixture(scope="module")
def sde_instance():
    card = rollout_card(CardCatalog(host()).get("wan-tiny"), noise_level=0.7, window=None)
    return tiny_instance(card)


@pytest.fixture(scope="module")
def grpo_records(sde_instance):
    results = run(engine_for(sde_instance), [request(seed=s, capture="steps", steps=4) for s in (0, 1)])
    return [r.artifact("behavior") for r in results]


def _training_log_probs(policy, record):
    sampler = sde_sampler_of(record.sampler)
    out = []
    for s in record.steps:
        nxt = record.steps[s.step + 1].latents if s.step + 1 < len(record.steps) else record.final_latents
        v = policy(as_input(s.latents), as_input(record.timesteps[s.step].reshape(1)), as_input(record.prompt_embeds)).float()
        mean, std = sde_mean_std(s.latents, v, record.sigmas[s.step], record.sigmas[s.step + 1], sampler.noise_level,
                                 float(record.sigmas[1]))
        out.append((v, gaussian_log_prob(nxt, mean, std)))
    return out


def test_grpo_rollout_log_probs_equal_the_training_forward_ratio_one(sde_instance, grpo_records):
    policy = copy.deepcopy(sde_instance.component("transformer")).train().requires_grad_(True)
    for record in grpo_records:
        assert all(s.stochastic and s.log_prob is not None for s in record.steps)
        for s, (v, log_prob) in zip(record.steps, _training_log_probs(policy, record)):
            assert v.requires_grad
            assert torch.equal(v.detach(), s.velocity)  # prediction-space identity, bit-exact
            ratio = torch.exp(log_prob - s.log_prob)
            assert torch.equal(ratio.detach(), torch.ones_like(ratio)), f"step {s.step}: ratio {ratio.item()}"


def test_grpo_ratio_negative_control_a_moved_policy_is_off_policy(sde_instance, grpo_records):
    policy = copy.deepcopy(sde_instance.component("transformer"))
    with torch.no_grad():
        policy.proj_out.weight.add_(0.05)
    record = grpo_records[0]
    ratios = [float(torch.exp(lp - s.log_prob)) for s, (_, lp) in zip(record.steps, _training_log_probs(policy, record))]
    assert max(abs(r - 1) for r in ratios) > 1e-4


def test_grpo_update_on_policy_reports_ratio_one(sde_instance, grpo_records):
    """The method's own update on fresh rollouts sees ratio exactly 1 on its first step."""
    from fv_rl.rollout import Rollout

    method = FlowGRPO(GRPOOptions())
    policy = copy.deepcopy(sde_instance.component("transformer")).requires_grad_(True)
    rollouts = [Rollout(prompt="a red fox", seed=i, record=r, video=torch.zeros(1), request_id=str(i)) for i, r in enumerate(grpo_records)]
    logged = method.update(policy, sde_instance.component("transformer"), None, rollouts, torch.tensor([1.0, -1.0]),
                           torch.Generator().manual_seed(0))
    assert logged["ratio_max_dev"] == 0.0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


def test_fast_window_captures_log_probs_only_inside_it():
    card = rollout_card(CardCatalog(host()).get("wan-tiny"), noise_level=0.7, window=(1, 3))
    (result,) = run(engine_for(tiny_instance(card)), [request(seed=0, capture="steps", steps=4)])
    record = result.artifact("behavior")
    assert [s.log_prob is not None for s in record.steps] == [False, True, True, False]
    assert [s.stochastic for s in record.steps] == [False, True, True, False]


def test_nft_seeded_sample_and_prediction_space_identity():
    """NFT's C2: the same seed gives the same final latents through the Engine (even batched with
    another request), and the training forward reproduces the rollout's velocity bit for bit."""
    instance = tiny_instance()
    a, b, _other = run(engine_for(instance), [request(seed=7, capture="steps"), request(seed=7, capture="final"),
                                              request(prompt="a blue lake", seed=1)])
    ra, rb = a.artifact("behavior"), b.artifact("behavior")
    assert torch.equal(ra.final_latents, rb.final_latents)
    policy = copy.deepcopy(instance.component("transformer")).requires_grad_(True)
    for s in ra.steps:
        v = policy(as_input(s.latents), as_input(ra.timesteps[s.step].reshape(1)), as_input(ra.prompt_embeds))
        assert v.requires_grad and torch.equal(v.detach().float(), s.velocity)
