"""The online RL loop shared by DiffusionNFT and Flow-GRPO (design §10).

Rollouts run through an :class:`~fv_kernel.api.Engine` serving the card's instance: the
engine's transformer is the rollout (old) policy theta_old. The learner trains a copy,
theta; after each update the new old-policy weights go into the serving instance through
``Engine.sync_weights`` (freeze admission, drain, load, bump ``weights_version``, clear
the caches keyed by it, resume). Evaluation is a fixed set of prompts and seeds sampled
deterministically through the same engine before training and after every epoch.

With ``options.lora`` (:mod:`fv_rl.lora`) theta, theta_old and theta_ref are adapters on one
frozen copy of the transformer, the sync sends only theta_old's adapter, and every rollout's
``weights_version`` is checked against the adapter the learner last sent.
"""

from __future__ import annotations

import abc
import asyncio
import copy
import json
import time
import uuid
from typing import Any, ClassVar, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from fv_kernel.api import (
    AdapterWeights,
    Engine,
    ModelInstance,
    ParityLevel,
    RecipeSpec,
    Reward,
    RLMethod,
    TrainedModel,
    TrainingRun,
    merge_adapters,
    resolve_reward,
)
from fv_rl.lora import (
    LORA_FILE, AdapterSlot, LoraOptions, LoraWeights, check_rollout_versions, copied_adapter, save_lora_file,
    sharing_clone, sync_adapter, target_paths,
)
from fv_rl.rollout import Rollout, RolloutSettings, rollout_groups

__all__ = ["OnlineOptions", "OnlineRL", "Learner", "RolloutBackend", "LocalBackend", "as_input", "group_advantages",
           "load_policy_into", "load_state_into"]

DEFAULT_PROMPTS = ("a red fox", "a green field", "a blue lake")


class OnlineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: A registered reward (``fv plugins list``: rewards) and its options.
    reward: str = "colour"
    reward_options: dict[str, Any] = Field(default_factory=dict)
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    #: K: samples per prompt per epoch (one homogeneous batch of requests).
    group_size: int = Field(default=4, ge=2)
    #: Rollout -> update rounds.
    epochs: PositiveInt = 6
    #: Gradient steps per epoch over that epoch's rollouts.
    inner_steps: PositiveInt = 1
    lr: float = Field(default=1e-4, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    #: Sampling steps, geometry (None: the card's defaults) of rollouts and evaluation.
    steps: PositiveInt = 6
    height: PositiveInt | None = None
    width: PositiveInt | None = None
    frames: PositiveInt | None = None
    #: Evaluation: these prompts (default: the training prompts) at these fixed seeds.
    eval_prompts: tuple[str, ...] | None = None
    eval_seeds: tuple[int, ...] = (1_000_000, 1_000_001)
    #: The class rollouts are scheduled at next to other traffic on the engine.
    priority: Literal["interactive", "batch"] = "batch"
    #: ``local``: one process (the Engine here, the learner here). ``ray``: rollout workers and the
    #: learner as Ray actors (needs ``ray``; ``ray.init`` here unless a cluster is already connected).
    orchestration: Literal["local", "ray"] = "local"
    #: Rollout actors under ``orchestration: ray`` (the prompts' groups are spread over them).
    rollout_workers: int = Field(default=2, ge=1)
    #: Train a LoRA on the transformer instead of its weights (None: full fine-tuning); see fv_rl.lora.
    lora: LoraOptions | None = None

    @model_validator(mode="after")
    def _prompts(self) -> "OnlineOptions":
        if not self.prompts:
            raise ValueError("prompts must name at least one prompt")
        return self


def as_input(tensor: torch.Tensor) -> torch.Tensor:
    """A captured tensor usable in a forward with grad: the engine's steps run under inference mode,
    and autograd refuses to save inference tensors; a copy made outside it is an ordinary tensor."""
    return tensor.clone() if tensor.is_inference() else tensor


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Per-prompt advantages of a (prompts, K) reward table: (R - mean) / (std + 1e-4), population std."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    return (rewards - mean) / (std + 1e-4)


def load_state_into(state: dict[str, torch.Tensor]) -> Any:
    """A ``sync_weights`` loader copying ``state`` into the instance's transformer, in place."""

    def load(instance: ModelInstance) -> None:
        with torch.no_grad():
            instance.component("transformer").load_state_dict(state)

    return load


def load_policy_into(module: torch.nn.Module) -> Any:
    """A ``sync_weights`` loader copying ``module``'s parameters into the instance's transformer, in place."""
    return load_state_into({k: v.detach().clone() for k, v in module.state_dict().items()})


class OnlineRL(RLMethod, abc.ABC):
    """Shared driver: rollouts through the Engine, rewards, the method's update, weight sync, evaluation."""

    required_parity: ClassVar[ParityLevel] = ParityLevel.C2
    options_schema: ClassVar[type[BaseModel]] = OnlineOptions
    #: What rollouts capture (``OutputSpec.capture_behavior``).
    capture: ClassVar[Literal["final", "steps"]] = "final"

    # -- method hooks -------------------------------------------------------------
    def rollout_card(self, card: Any) -> Any:
        """The card rollouts serve (default: the run's own card)."""
        return card

    def rollout_instance(self, run: TrainingRun) -> ModelInstance:
        """The instance rollouts run on in this process (default: the run's own)."""
        return run.instance

    def rollout_sampler(self) -> str | None:
        return None

    def eval_sampler(self) -> str | None:
        return None

    @abc.abstractmethod
    def update(self, policy: torch.nn.Module, old: torch.nn.Module, ref: torch.nn.Module | None,
               rollouts: list[Rollout], advantages: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """One gradient step's loss over ``rollouts`` (backward is called here); returns scalars to log."""

    def after_epoch(self, policy: torch.nn.Module, old: torch.nn.Module, epoch: int) -> torch.nn.Module:
        """The module whose weights the serving instance loads after ``epoch`` (default: the policy)."""
        return policy

    # -- the loop -------------------------------------------------------------------
    def settings(self, sampler: str | None, capture: Literal["final", "steps"]) -> RolloutSettings:
        o: OnlineOptions = self.options  # type: ignore[assignment]
        return RolloutSettings(steps=o.steps, guidance=1.0, height=o.height, width=o.width, frames=o.frames,
                               sampler=sampler, capture=capture, priority=o.priority)

    def train(self, run: TrainingRun) -> TrainedModel:
        o: OnlineOptions = self.options  # type: ignore[assignment]
        reward = resolve_reward(o.reward, o.reward_options)
        history: dict[str, list[Any]] = {"epoch": [], "eval_reward": [], "train_reward": [], "seconds": []}
        if o.orchestration == "ray":
            from fv_rl.distributed import run_with_ray

            instance = run.instance
            old = instance.component("transformer")
            final = run_with_ray(self, run, reward, history)
        else:
            instance = self.rollout_instance(run)
            old = instance.component("transformer")
            learner = Learner(self, old, run.recipe.seed, owns_old=False)
            asyncio.run(self._run_local(run, instance, reward, learner, history))
            final = learner.weights()
        if isinstance(final, AdapterWeights):
            # The exported card carries the adapter merged in; the adapter itself goes beside it.
            merge_adapters(old, [(copied_adapter(final, next(old.parameters()).device), 1.0)])
        elif o.orchestration == "ray":
            with torch.no_grad():
                old.load_state_dict(final)
        self._write_curves(run, history)
        lora_note = ""
        if o.lora is not None:
            lora_note = f", LoRA rank {o.lora.rank} alpha {o.lora.lora_alpha:g} on {o.lora.target_modules}"
        recipe = RecipeSpec(
            # What the exported card's serving needs (its parity is checked at export: C1 against diffusers);
            # the rollout-side C2 this method relied on is tested on the loops (tests/test_c2.py).
            method=self.name, parents=(run.card.model_id,), consistency_required=ParityLevel.C1,
            data_contract=(
                f"online RL: reward {o.reward} {dict(o.reward_options) or ''}on {len(o.prompts)} prompts x K={o.group_size}, "
                f"{o.epochs} epochs x {o.inner_steps} steps, {o.steps} sampling steps, lr {o.lr}, seed {run.recipe.seed}{lora_note}"
            ),
        )
        if isinstance(final, AdapterWeights):
            save_lora_file(final, run.output / LORA_FILE, {
                "method": self.name, "base_card": run.card.model_id, "model_id": run.recipe.output_model_id or "",
                "steps": {"epochs": o.epochs, "updates": o.epochs * o.inner_steps}, "reward": o.reward,
                "seed": run.recipe.seed, "data_contract": recipe.data_contract,
            })
        # The exported card defaults to what the policy was optimised under (its parity check at
        # export runs there too): the rollouts' steps and geometry, guidance off.
        geometry = {k: v for k, v in (("frames", o.frames), ("height", o.height), ("width", o.width)) if v is not None}
        return TrainedModel(
            modules={"transformer": old.cpu(), "text_encoder": instance.component("text_encoder").cpu()},
            recipe=recipe, steps={"epochs": o.epochs, "updates": o.epochs * o.inner_steps},
            defaults={"steps": o.steps, "guidance": 1.0, **geometry},
        )

    def _kl_weight(self) -> float:
        return float(getattr(self.options, "kl_weight", 0.0))

    def epoch_seeds(self, seed: int, epoch: int) -> list[list[int]]:
        """The rollout seeds of ``epoch``: one list of K per training prompt, distinct across epochs and prompts."""
        o: OnlineOptions = self.options  # type: ignore[assignment]
        return [[seed * 10_000_000 + epoch * 100_000 + p * 1000 + k for k in range(o.group_size)] for p in range(len(o.prompts))]

    def eval_prompts(self) -> tuple[str, ...]:
        o: OnlineOptions = self.options  # type: ignore[assignment]
        return o.eval_prompts or o.prompts

    @staticmethod
    def score(reward: Reward, rollouts: Sequence[Rollout]) -> torch.Tensor:
        return reward.score(torch.stack([r.video for r in rollouts]), [r.prompt for r in rollouts]).float()

    async def run_epochs(self, run: TrainingRun, backend: "RolloutBackend", reward: Reward, learner: Any,
                         history: dict[str, list[Any]]) -> None:
        """Evaluate, then per epoch: rollouts -> rewards -> advantages -> update -> weight sync -> evaluate.

        ``backend`` runs rollouts and loads weights (this process's Engine, or Ray actors);
        ``learner.update(rollouts, advantages, epoch)`` (maybe remote, awaited) returns the
        logged scalars and the new rollout-policy weights.
        """
        o: OnlineOptions = self.options  # type: ignore[assignment]
        start = time.perf_counter()
        eval_settings = self.settings(self.eval_sampler(), "final")
        # LoRA: every rollout must come from the adapter the learner last sent (its version is in the record).
        expected: str | None = None
        if o.lora is not None:
            initial = await learner.weights()
            await backend.load(initial)
            expected = initial.version

        async def evaluate() -> float:
            prompts = self.eval_prompts()
            groups = await backend.rollout(prompts, [list(o.eval_seeds)] * len(prompts), eval_settings)
            rollouts = [r for g in groups for r in g]
            if expected is not None:
                check_rollout_versions(rollouts, expected)
            return float(self.score(reward, rollouts).mean())

        history["epoch"].append(0)
        history["eval_reward"].append(await evaluate())
        history["train_reward"].append(None)
        history["seconds"].append(round(time.perf_counter() - start, 1))
        run.report("rl", 0, o.epochs, {"eval_reward": history["eval_reward"][-1]})
        for epoch in range(1, o.epochs + 1):
            groups = await backend.rollout(o.prompts, self.epoch_seeds(run.recipe.seed, epoch),
                                           self.settings(self.rollout_sampler(), self.capture))
            if expected is not None:
                check_rollout_versions([r for g in groups for r in g], expected)
            table = torch.stack([self.score(reward, g) for g in groups])  # (prompts, K)
            advantages = group_advantages(table)
            logged, state = await learner.update([r for g in groups for r in g], advantages.flatten(), epoch)
            await backend.load(state)
            if isinstance(state, AdapterWeights):
                expected = state.version
            score = await evaluate()
            history["epoch"].append(epoch)
            history["eval_reward"].append(score)
            history["train_reward"].append(float(table.mean()))
            history["seconds"].append(round(time.perf_counter() - start, 1))
            run.report("rl", epoch, o.epochs, {"eval_reward": score, "train_reward": float(table.mean()), **logged})

    async def _run_local(self, run: TrainingRun, instance: ModelInstance, reward: Reward, learner: "Learner",
                         history: dict[str, list[Any]]) -> None:
        engine = Engine()
        engine.add_instance(instance)
        backend = LocalBackend(engine, instance.model_id)
        try:
            async with engine.running():
                await self.run_epochs(run, backend, reward, _AsyncLearner(learner), history)
        finally:
            backend.close()  # the rollout adapter's hooks off the transformer

    def _write_curves(self, run: TrainingRun, history: dict[str, list[Any]]) -> None:
        o: OnlineOptions = self.options  # type: ignore[assignment]
        run.output.mkdir(parents=True, exist_ok=True)
        (run.output / "rewards.json").write_text(json.dumps({"method": self.name, "reward": o.reward, **history}, indent=1))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(history["epoch"], history["eval_reward"], marker="o", label="eval (fixed seeds)")
        train = [(e, r) for e, r in zip(history["epoch"], history["train_reward"]) if r is not None]
        if train:
            ax.plot([e for e, _ in train], [r for _, r in train], marker=".", linestyle="--", label="rollouts")
        ax.set_xlabel("epoch (update)")
        ax.set_ylabel(f"{o.reward} reward")
        ax.set_title(f"{self.name} on {run.card.model_id}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(run.output / "reward_curve.png", dpi=100)
        plt.close(fig)



#: What a weight sync carries: the transformer's full state dict, or (LoRA) theta_old's adapter.
SyncPayload = dict[str, torch.Tensor] | AdapterWeights


class Learner:
    """theta (trained), theta_old (the rollout policy), theta_ref (KL anchor) and the optimizer.

    ``owns_old``: whether this learner keeps its own theta_old (a Ray learner) or shares the
    module the local Engine serves, which the weight sync then updates in place.

    With ``options.lora`` the three are one frozen transformer seen through adapters: the policy
    is a :func:`~fv_rl.lora.sharing_clone` applying the trainable adapter, theta_ref a clone
    applying none (the base), and theta_old the served module with the adapter last synced (or,
    owning it, this learner's module with that adapter). Only the adapter's A/B are optimised.
    """

    def __init__(self, method: OnlineRL, old: torch.nn.Module, seed: int, *, owns_old: bool) -> None:
        o: OnlineOptions = method.options  # type: ignore[assignment]
        self.method, self.old, self.owns_old = method, old, owns_old
        self.generator = torch.Generator().manual_seed(seed)
        self.lora: LoraWeights | None = None
        if o.lora is None:
            self.policy = copy.deepcopy(old).train().requires_grad_(True)
            self.ref = copy.deepcopy(old).eval().requires_grad_(False) if method._kl_weight() > 0 else None
            old.eval().requires_grad_(False)
            self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=o.lr, weight_decay=0.0)
            return
        old.eval().requires_grad_(False)  # the base: frozen, shared by every view below
        paths = target_paths(old, o.lora.target_modules)
        # Its own generator: the training noise draws stay those of the full fine-tuning run.
        self.lora = LoraWeights(old, paths, o.lora.rank, o.lora.lora_alpha, torch.Generator().manual_seed(seed))
        self.old_lora = copy.deepcopy(self.lora)
        self.policy = sharing_clone(old).train()
        AdapterSlot(self.policy, paths).set(self.lora.adapter(f"{method.name}-policy", "live"))
        self.ref = sharing_clone(old).eval() if method._kl_weight() > 0 else None
        # Versions label the adapters this run sends (unique per run; no content hash, see LoraWeights.adapter).
        self.tag = f"{method.name}-{uuid.uuid4().hex[:8]}"
        self.synced = self._payload(0)
        if owns_old:
            self.old_slot = AdapterSlot(old, paths)
            self.old_slot.set(self.synced)
        self.optimizer = torch.optim.AdamW(self.lora.parameters(), lr=o.lr, weight_decay=0.0)

    def _payload(self, epoch: int) -> AdapterWeights:
        assert self.lora is not None
        return self.old_lora.adapter(f"{self.method.name}-lora", f"{self.tag}.{epoch}", detach=True)

    def weights(self) -> SyncPayload:
        """The rollout policy's weights as a sync sends them (LoRA: theta_old's adapter only)."""
        if self.lora is not None:
            return self.synced
        return {k: v.detach().clone() for k, v in self.old.state_dict().items()}

    def update(self, rollouts: list[Rollout], advantages: torch.Tensor, epoch: int) -> tuple[dict[str, float], SyncPayload]:
        """``inner_steps`` gradient steps, then the new theta_old: (logged scalars, what the sync sends)."""
        o: OnlineOptions = self.method.options  # type: ignore[assignment]
        trained = self.lora if self.lora is not None else self.policy
        logged: dict[str, float] = {}
        for _ in range(o.inner_steps):
            self.optimizer.zero_grad(set_to_none=True)
            logged = self.method.update(self.policy, self.old, self.ref, rollouts, advantages, self.generator)
            torch.nn.utils.clip_grad_norm_(trained.parameters(), o.max_grad_norm)
            self.optimizer.step()
        if self.lora is not None:
            # theta_old's adapter follows the method's rule on the adapter weights (NFT: their EMA; GRPO: theta).
            source = self.method.after_epoch(self.lora, self.old_lora, epoch)
            if source is not self.old_lora:
                self.old_lora.copy_from(source)
            self.synced = self._payload(epoch)
            if self.owns_old:
                self.old_slot.set(self.synced)
            return logged, self.synced
        source = self.method.after_epoch(self.policy, self.old, epoch)
        state = {k: v.detach().clone() for k, v in source.state_dict().items()}
        if self.owns_old:
            with torch.no_grad():
                self.old.load_state_dict(state)
        return logged, state


class _AsyncLearner:
    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    async def weights(self) -> SyncPayload:
        return self.learner.weights()

    async def update(self, rollouts: list[Rollout], advantages: torch.Tensor, epoch: int) -> tuple[dict[str, float], SyncPayload]:
        return self.learner.update(rollouts, advantages, epoch)


class RolloutBackend(abc.ABC):
    """Where rollouts run and rollout-policy weights are loaded."""

    @abc.abstractmethod
    async def rollout(self, prompts: Sequence[str], seeds: Sequence[Sequence[int]], settings: RolloutSettings) -> list[list[Rollout]]:
        """One group per prompt."""

    @abc.abstractmethod
    async def load(self, state: SyncPayload) -> None:
        """Load new rollout-policy weights on every engine: a full transformer state dict, or an adapter."""


class LocalBackend(RolloutBackend):
    """This process's Engine."""

    def __init__(self, engine: Engine, model_id: str) -> None:
        self.engine, self.model_id = engine, model_id
        self.slot: AdapterSlot | None = None

    async def rollout(self, prompts: Sequence[str], seeds: Sequence[Sequence[int]], settings: RolloutSettings) -> list[list[Rollout]]:
        return await rollout_groups(self.engine, self.model_id, prompts, seeds, settings)

    async def load(self, state: SyncPayload) -> None:
        if isinstance(state, AdapterWeights):
            self.slot = await sync_adapter(self.engine, self.model_id, self.slot, state)
        else:
            await self.engine.sync_weights(self.model_id, load_state_into(state))

    def close(self) -> None:
        if self.slot is not None:
            self.slot.remove()
            self.slot = None
