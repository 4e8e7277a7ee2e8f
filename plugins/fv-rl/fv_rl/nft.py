"""DiffusionNFT (likelihood-free online RL for flow models; NVlabs/DiffusionNFT), method ``nft``.

Rollouts sample the old policy deterministically (the card's ODE sampler, CFG off) and
capture the final latents only (``capture_behavior="final"``). Per rollout, with reward R:

- A = (R - mean_prompt) / (std_prompt + 1e-4); r = clamp(clip(A, -5, 5) / 5 / 2 + 1/2, 0, 1);
- over the rollout's own sigma grid (shuffled), fresh eps: x_t = (1 - t) x0 + t eps;
- v+ = beta v_theta + (1 - beta) v_old, v- = (1 + beta) v_old - beta v_theta, x0^+- = x_t - t v^+-;
- L^+- = mean((x0^+- - x0)^2) / sg(max(mean|x0^+- - x0|, 1e-5)) (the adaptive x0 loss);
- L = mean(5 (r L+ + (1 - r) L-) / beta) + kl_weight mean|v_theta - v_ref|^2.

After each epoch the old policy decays towards the policy: theta_old <- d theta_old + (1 - d) theta,
d = min(decay_rate * max(0, epoch - decay_flat), decay_max); the serving instance then loads theta_old.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import BaseModel, Field

from fv_rl.online import OnlineOptions, OnlineRL, as_input
from fv_rl.rollout import Rollout

__all__ = ["DiffusionNFT", "NFTOptions", "nft_loss", "optimality_probability", "old_policy_decay"]

TIMESTEP_SCALE = 1000.0


class NFTOptions(OnlineOptions):
    beta: float = Field(default=1.0, gt=0)
    kl_weight: float = Field(default=1e-4, ge=0)
    #: Grid timesteps trained per rollout per step (None: every step of the rollout's grid).
    train_timesteps: int | None = Field(default=None, ge=1)
    decay_rate: float = Field(default=1e-3, ge=0)
    decay_flat: int = Field(default=0, ge=0)
    decay_max: float = Field(default=0.5, ge=0, lt=1)


def optimality_probability(advantages: torch.Tensor) -> torch.Tensor:
    """r = clamp(clip(A, -5, 5) / 5 * 1/2 + 1/2, 0, 1)."""
    return (advantages.clamp(-5, 5) / 5 * 0.5 + 0.5).clamp(0, 1)


def old_policy_decay(epoch: int, rate: float, flat: int, maximum: float) -> float:
    """d = min(rate * max(0, epoch - flat), maximum)."""
    return min(rate * max(0, epoch - flat), maximum)


def _adaptive_x0_loss(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    dims = tuple(range(1, x0.ndim))
    error = x0_hat.float() - x0.float()
    weight = error.abs().mean(dim=dims).detach().clamp_min(1e-5)
    return error.pow(2).mean(dim=dims) / weight


def nft_loss(
    v_theta: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, r: torch.Tensor,
    beta: float, v_ref: torch.Tensor | None = None, kl_weight: float = 0.0,
) -> torch.Tensor:
    """The DiffusionNFT loss of one batch: ``t`` (B,) in (0, 1], ``r`` (B,) optimality probabilities."""
    tb = t.reshape(-1, *([1] * (x0.ndim - 1)))
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    loss_pos = _adaptive_x0_loss(x_t - tb * v_pos, x0)
    loss_neg = _adaptive_x0_loss(x_t - tb * v_neg, x0)
    loss = (5 * (r * loss_pos + (1 - r) * loss_neg) / beta).mean()
    if v_ref is not None and kl_weight > 0:
        loss = loss + kl_weight * (v_theta.float() - v_ref.float()).pow(2).mean()
    return loss


class DiffusionNFT(OnlineRL):
    name: ClassVar[str] = "nft"
    options_schema: ClassVar[type[BaseModel]] = NFTOptions
    capture = "final"

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        o: NFTOptions = self.options  # type: ignore[assignment]
        return nft_loss(batch["v_theta"], batch["v_old"], batch["x_t"], batch["x0"], batch["t"], batch["r"], o.beta,
                        batch.get("v_ref"), o.kl_weight)

    def update(self, policy: torch.nn.Module, old: torch.nn.Module, ref: torch.nn.Module | None,
               rollouts: list[Rollout], advantages: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        o: NFTOptions = self.options  # type: ignore[assignment]
        r = optimality_probability(advantages)
        x0 = as_input(torch.cat([ro.record.final_latents for ro in rollouts]).float())
        context = as_input(torch.cat([ro.record.prompt_embeds for ro in rollouts]).float())
        grid = as_input(rollouts[0].record.sigmas[:-1])  # the rollout's own timesteps (sigma > 0)
        order = torch.randperm(len(grid), generator=generator)
        chosen = order[: o.train_timesteps] if o.train_timesteps else order
        total = 0.0
        for index in chosen.tolist():
            t = grid[index].expand(len(rollouts)).float()
            noise = torch.randn(x0.shape, generator=generator)
            tb = t.reshape(-1, *([1] * (x0.ndim - 1)))
            x_t = (1 - tb) * x0 + tb * noise
            timestep = t * TIMESTEP_SCALE
            with torch.no_grad():
                v_old = old(x_t, timestep, context).float()
                v_ref = ref(x_t, timestep, context).float() if ref is not None else None
            v_theta = policy(x_t, timestep, context).float()
            loss = self.loss({"v_theta": v_theta, "v_old": v_old, "x_t": x_t, "x0": x0, "t": t, "r": r, "v_ref": v_ref})
            (loss / len(chosen)).backward()
            total += float(loss.detach()) / len(chosen)
        return {"loss": total}

    def after_epoch(self, policy: torch.nn.Module, old: torch.nn.Module, epoch: int) -> torch.nn.Module:
        """theta_old <- d theta_old + (1 - d) theta, computed on a copy the serving instance then loads."""
        o: NFTOptions = self.options  # type: ignore[assignment]
        d = old_policy_decay(epoch, o.decay_rate, o.decay_flat, o.decay_max)
        import copy

        target = copy.deepcopy(old)
        with torch.no_grad():
            for t_param, p_param in zip(target.parameters(), policy.parameters()):
                t_param.mul_(d).add_(p_param.detach(), alpha=1 - d)
        return target
