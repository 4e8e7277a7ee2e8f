"""DiffusionNFT and Flow-GRPO objectives: the invariants of shared/reference/rl.md."""

from __future__ import annotations

import copy

import pytest
import torch

from fv_rl.grpo import grpo_loss
from fv_rl.nft import DiffusionNFT, NFTOptions, nft_loss, old_policy_decay, optimality_probability
from fv_rl.online import group_advantages
from rl_helpers import tiny_instance


@pytest.fixture(scope="module")
def transformer():
    return tiny_instance().component("transformer")


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2, 16, 2, 4, 4, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.tensor([0.7, 0.3])
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
    context = torch.randn(2, 8, 32, generator=g)
    return x0, x_t, t, context


def _nft_grad(policy, old, ref, r, beta=1.0, kl=1e-4):
    x0, x_t, t, context = _batch()
    policy.zero_grad(set_to_none=True)
    v_theta = policy(x_t, t * 1000, _ctx(policy, context))
    with torch.no_grad():
        v_old = old(x_t, t * 1000, _ctx(old, context))
        v_ref = ref(x_t, t * 1000, _ctx(ref, context))
    nft_loss(v_theta, v_old, x_t, x0, t, r, beta, v_ref, kl).backward()
    return torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])


def _ctx(model, context):
    width = model.config.text_dim
    return torch.nn.functional.pad(context, (0, max(0, width - context.shape[-1])))[..., :width]


def test_nft_with_theta_equal_old_and_r_one_half_has_zero_gradient(transformer):
    policy = copy.deepcopy(transformer).requires_grad_(True)
    grad = _nft_grad(policy, transformer, transformer, torch.full((2,), 0.5))
    assert grad.numel() > 0 and grad.abs().max() < 1e-6


def test_nft_gradient_is_nonzero_off_the_invariant(transformer):
    """Negative controls: r != 1/2, or theta != theta_old, give a gradient."""
    policy = copy.deepcopy(transformer).requires_grad_(True)
    assert _nft_grad(policy, transformer, transformer, torch.tensor([0.9, 0.1]), kl=0).abs().max() > 1e-4
    moved = copy.deepcopy(transformer)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy = copy.deepcopy(moved).requires_grad_(True)
    assert _nft_grad(policy, transformer, moved, torch.full((2,), 0.5), kl=0).abs().max() > 1e-4


def test_nft_positive_samples_pull_towards_their_x0():
    """With r = 1 the loss is the adaptive x0 loss of v+ = v_theta: it is 0 exactly at the true velocity."""
    x0, x_t, t, _ = _batch()
    true_v = (x_t - x0) / t.view(-1, 1, 1, 1, 1)
    loss_true = nft_loss(true_v, true_v, x_t, x0, t, torch.ones(2), 1.0)
    loss_off = nft_loss(true_v + 0.1, true_v, x_t, x0, t, torch.ones(2), 1.0)
    assert float(loss_true) < 1e-5 < float(loss_off)


def test_advantages_optimality_probability_and_decay():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0]])
    adv = group_advantages(rewards)
    torch.testing.assert_close(adv[0], (rewards[0] - 2.5) / (rewards[0].std(unbiased=False) + 1e-4))
    assert torch.equal(adv[1], torch.zeros(4))
    r = optimality_probability(torch.tensor([-10.0, -5.0, 0.0, 2.5, 7.0]))
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0]))
    assert old_policy_decay(0, 1e-3, 0, 0.5) == 0.0
    assert old_policy_decay(100, 1e-3, 50, 0.5) == pytest.approx(0.05)
    assert old_policy_decay(10_000, 1e-3, 0, 0.5) == 0.5


def test_nft_old_policy_update_is_the_ema(transformer):
    method = DiffusionNFT(NFTOptions(decay_rate=0.1, decay_max=0.5))
    policy = copy.deepcopy(transformer)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    new_old = method.after_epoch(policy, transformer, epoch=3)  # d = 0.3
    p_old, p_pol, p_new = (next(m.parameters()) for m in (transformer, policy, new_old))
    torch.testing.assert_close(p_new, 0.3 * p_old + 0.7 * p_pol)


def test_grpo_ratio_is_one_on_policy_and_the_loss_is_minus_the_advantage():
    log_prob = torch.tensor([-1.3, -0.2, 4.0])
    advantages = torch.tensor([1.0, -2.0, 0.5])
    loss, ratio = grpo_loss(log_prob, log_prob.clone(), advantages, 1e-3)
    assert torch.equal(ratio, torch.ones(3))
    assert float(loss) == pytest.approx(float(-advantages.mean()))


def test_grpo_clip_stops_the_gradient_outside_the_trust_region():
    old = torch.zeros(2)
    lp = torch.tensor([0.5, -0.5], requires_grad=True)  # ratio e^0.5 (A>0) and e^-0.5 (A<0): both clipped
    loss, _ = grpo_loss(lp, old, torch.tensor([1.0, -1.0]), 1e-3)
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2))
    inside = torch.tensor([1e-4, -1e-4], requires_grad=True)
    grpo_loss(inside, old, torch.tensor([1.0, 1.0]), 1e-3)[0].backward()
    assert (inside.grad != 0).all()
