"""Flow-GRPO (yifan123/flow_grpo), method ``grpo``: per-step log-probs through an SDE sampler.

Rollouts run the card's denoise loop with the ``flow-sde`` sampler (this plugin's
:class:`~fv_rl.sde.FlowSDESampler`, bound to the rollout instance's loop) and capture every
step (``capture_behavior="steps"``): latents, the model output, the noise and the step's
log-prob. The objective per SDE step j and rollout i with group advantage A_i:

    ratio = exp(logp_theta - logp_old)
    L = mean(max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps))) + kl_weight mean|mu_theta - mu_ref|^2 / (2 std^2)

``sde_window`` (Flow-GRPO-Fast) makes only those steps SDE (the rest ODE) and trains only them.
Evaluation samples with the Euler ODE on the same schedule.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, Field

from fv_kernel.api import ModelInstance, SamplerBinding, TrainingRun
from fv_rl.online import OnlineOptions, OnlineRL, as_input
from fv_rl.rollout import Rollout
from fv_rl.sde import FlowSDESampler, gaussian_log_prob, sde_mean_std

__all__ = ["FlowGRPO", "GRPOOptions", "grpo_loss", "rollout_card", "sde_sampler_of"]


class GRPOOptions(OnlineOptions):
    noise_level: float = Field(default=0.7, ge=0)
    #: [start, stop) SDE steps (Flow-GRPO-Fast); None: every step is SDE and trained.
    sde_window: tuple[int, int] | None = None
    clip_range: float = Field(default=1e-3, gt=0, lt=1)
    kl_weight: float = Field(default=0.0, ge=0)


def grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped policy loss, ratio) of one step over a batch."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    return torch.maximum(unclipped, clipped).mean(), ratio


def sde_sampler_of(signature: str) -> FlowSDESampler:
    """The SDE sampler a behaviour record's ``sampler`` signature names."""
    name, _, config = signature.partition(":")
    if name != FlowSDESampler.name:
        raise ValueError(f"the rollout was sampled with {name!r}, not {FlowSDESampler.name!r}: it has no log-probs")
    return FlowSDESampler(**json.loads(config))


def rollout_card(card: Any, noise_level: float, window: tuple[int, int] | None) -> Any:
    """``card`` with its default denoise loop bound to the SDE sampler (the card's shift kept)."""
    loop_id = "denoise"
    spec = card.loops[loop_id]
    shift = (spec.sampler.config or {}).get("shift", 1.0) if spec.sampler is not None else 1.0
    config: dict[str, Any] = {"shift": shift, "noise_level": noise_level}
    if window is not None:
        config["sde_window"] = list(window)
    loops = dict(card.loops)
    loops[loop_id] = spec.model_copy(update={"sampler": SamplerBinding(name=FlowSDESampler.name, config=config)})
    return card.model_copy(update={"loops": loops})


class FlowGRPO(OnlineRL):
    name: ClassVar[str] = "grpo"
    needs_logprobs: ClassVar[bool] = True
    options_schema: ClassVar[type[BaseModel]] = GRPOOptions
    capture = "steps"

    def rollout_card(self, card: Any) -> Any:
        o: GRPOOptions = self.options  # type: ignore[assignment]
        return rollout_card(card, o.noise_level, o.sde_window)

    def rollout_instance(self, run: TrainingRun) -> ModelInstance:
        """The run's instance (its very modules: no second copy), serving a card whose loop samples the SDE."""
        base = run.instance
        base.component("transformer")
        base.component("text_encoder")
        return dataclasses.replace(
            base, card=self.rollout_card(base.card), instance_id=uuid.uuid4().hex[:12],
            components=base.components, _ops=dict(base.ops), _loops={}, _lock=threading.Lock(),
        )

    def eval_sampler(self) -> str | None:
        return "euler"  # the ODE on the same schedule: deterministic evaluation

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        o: GRPOOptions = self.options  # type: ignore[assignment]
        return grpo_loss(batch["log_prob"], batch["old_log_prob"], batch["advantages"], o.clip_range)[0]

    def update(self, policy: torch.nn.Module, old: torch.nn.Module, ref: torch.nn.Module | None,
               rollouts: list[Rollout], advantages: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        o: GRPOOptions = self.options  # type: ignore[assignment]
        record0 = rollouts[0].record
        sampler = sde_sampler_of(record0.sampler)
        sigma_max = float(record0.sigmas[1])  # as the rollout's sampler took it (flow_grpo's sigmas[1])
        context = as_input(torch.cat([r.record.prompt_embeds for r in rollouts]).float())
        steps = [s.step for s in record0.steps if s.log_prob is not None]
        total, ratios = 0.0, []
        for j in steps:
            x = as_input(torch.cat([r.record.steps[j].latents for r in rollouts]).float())
            nxt = torch.cat([(r.record.steps[j + 1].latents if j + 1 < len(r.record.steps) else r.record.final_latents)
                             for r in rollouts]).float()
            nxt = as_input(nxt)
            old_log_prob = torch.cat([r.record.steps[j].log_prob for r in rollouts])
            timestep = as_input(record0.timesteps[j].expand(len(rollouts)))
            sigma, sigma_next = record0.sigmas[j], record0.sigmas[j + 1]
            # Row by row, as the serving op dispatches rows ("sequential"): the same kernels on the same
            # shapes, so on-policy the recomputed log-prob equals the captured one and the ratio is exactly 1.
            v_theta = torch.cat([policy(x[i : i + 1], timestep[i : i + 1], context[i : i + 1]) for i in range(len(x))]).float()
            mean, std = sde_mean_std(x, v_theta, sigma, sigma_next, sampler.noise_level, sigma_max)
            log_prob = gaussian_log_prob(nxt, mean, std)
            loss, ratio = grpo_loss(log_prob, old_log_prob, advantages, o.clip_range)
            if ref is not None and o.kl_weight > 0:
                with torch.no_grad():
                    v_ref = torch.cat([ref(x[i : i + 1], timestep[i : i + 1], context[i : i + 1]) for i in range(len(x))]).float()
                mean_ref, _ = sde_mean_std(x, v_ref, sigma, sigma_next, sampler.noise_level, sigma_max)
                loss = loss + o.kl_weight * ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, x.ndim))).div(2 * std**2).mean()
            (loss / len(steps)).backward()
            total += float(loss.detach()) / len(steps)
            ratios.append(ratio.detach())
        ratio_all = torch.cat(ratios)
        return {"loss": total, "ratio_max_dev": float((ratio_all - 1).abs().max())}
