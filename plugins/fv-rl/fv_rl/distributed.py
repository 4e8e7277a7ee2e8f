"""Ray orchestration (``options.orchestration: ray``): rollout workers and the learner as Ray actors.

Ray Core is the engine here: no home-made cluster. Each rollout worker is an async actor
holding its own Engine over the rollout card (the serving loops plus capture, exactly as in
one process); the learner actor holds theta, theta_old, theta_ref and the optimizer and
returns the new theta_old after each epoch; the driver (this process) computes rewards and
advantages, spreads each epoch's prompt groups over the workers and pushes the new weights to
every worker with ``Engine.sync_weights`` (with ``options.lora``: the adapter alone). Behaviour
records cross process boundaries as their ``to_bytes`` (the same bytes ``torch.save`` writes).
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import torch

from fv_kernel.api import BehaviorRecord, InvalidRequest, Reward, TrainingRun, run_blocking
from fv_rl.online import OnlineRL, RolloutBackend
from fv_rl.rollout import Rollout, RolloutSettings

__all__ = ["RolloutWorker", "LearnerActor", "RayBackend", "run_with_ray"]


def _pack(groups: list[list[Rollout]]) -> list[list[tuple[str, int, bytes, torch.Tensor, str]]]:
    return [[(r.prompt, r.seed, r.record.to_bytes(), r.video.clone(), r.request_id) for r in g] for g in groups]


def _unpack(groups: list[list[tuple[str, int, bytes, torch.Tensor, str]]]) -> list[list[Rollout]]:
    return [[Rollout(prompt=p, seed=s, record=BehaviorRecord.from_bytes(b), video=v, request_id=i) for p, s, b, v, i in g]
            for g in groups]


class RolloutWorker:
    """A Ray actor: an Engine serving the rollout card; rollouts and weight syncs on request."""

    def __init__(self, card_json: str, source: str | None, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        from fv_kernel.api import Engine, InstanceOptions, ModelCard, PluginHost, build_instance

        host = PluginHost()
        host.start()
        card = ModelCard.model_validate_json(card_json)
        self.instance = build_instance(card, InstanceOptions(device="cpu", precision="fp32", registry=host.registry(),
                                                             source=source))
        self.engine = Engine()
        self.engine.add_instance(self.instance)
        self._started = False
        self.slot: Any = None  # options.lora: the rollout adapter's slot (fv_rl.lora.AdapterSlot), installed on first sync

    async def _start(self) -> None:
        if not self._started:
            await self.engine.start()
            self._started = True

    async def rollout(self, prompts: Sequence[str], seeds: Sequence[Sequence[int]], settings: RolloutSettings) -> Any:
        from fv_rl.rollout import rollout_groups

        await self._start()
        return _pack(await rollout_groups(self.engine, self.instance.model_id, prompts, seeds, settings))

    async def load(self, state: Any) -> str:
        """A weight sync: the transformer's state dict, or (``options.lora``) the adapter alone."""
        from fv_kernel.api import AdapterWeights
        from fv_rl.lora import sync_adapter
        from fv_rl.online import load_state_into

        await self._start()
        if isinstance(state, AdapterWeights):
            self.slot = await sync_adapter(self.engine, self.instance.model_id, self.slot, state)
            return self.instance.weights_version
        return await self.engine.sync_weights(self.instance.model_id, load_state_into(state))

    async def shutdown(self) -> None:
        if self._started:
            await self.engine.stop()
            self._started = False


class LearnerActor:
    """A Ray actor: the method's :class:`~fv_rl.online.Learner` over its own copy of the transformer."""

    def __init__(self, method: OnlineRL, card_json: str, source: str | None, seed: int, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        from fv_kernel.api import InstanceOptions, ModelCard, build_instance
        from fv_rl.online import Learner

        instance = build_instance(ModelCard.model_validate_json(card_json),
                                  InstanceOptions(device="cpu", precision="fp32", source=source))
        self.learner = Learner(method, instance.component("transformer"), seed, owns_old=True)

    def weights(self) -> Any:
        """theta_old as a sync sends it: the state dict, or (``options.lora``) its adapter."""
        return self.learner.weights()

    def update(self, groups: Any, advantages: torch.Tensor, epoch: int) -> tuple[dict[str, float], Any]:
        rollouts = [r for g in _unpack(groups) for r in g]
        return self.learner.update(rollouts, advantages, epoch)


class RayBackend(RolloutBackend):
    """Rollout groups spread round-robin over the worker actors; weights pushed to all of them."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    async def rollout(self, prompts: Sequence[str], seeds: Sequence[Sequence[int]], settings: RolloutSettings) -> list[list[Rollout]]:
        n = len(self.workers)
        shards = [[i for i in range(len(prompts)) if i % n == w] for w in range(n)]
        refs = [(shard, self.workers[w].rollout.remote([prompts[i] for i in shard], [seeds[i] for i in shard], settings))
                for w, shard in enumerate(shards) if shard]
        groups: list[list[Rollout] | None] = [None] * len(prompts)
        for shard, ref in refs:
            for i, group in zip(shard, _unpack(await ref)):
                groups[i] = group
        return groups  # type: ignore[return-value]

    async def load(self, state: Any) -> None:
        await asyncio.gather(*(w.load.remote(state) for w in self.workers))


class _RemoteLearner:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def weights(self) -> Any:
        return await self.actor.weights.remote()

    async def update(self, rollouts: list[Rollout], advantages: torch.Tensor, epoch: int) -> Any:
        return await self.actor.update.remote(_pack([rollouts]), advantages, epoch)


def run_with_ray(method: OnlineRL, run: TrainingRun, reward: Reward, history: dict[str, list[Any]]) -> Any:
    """Train with Ray actors; returns the final rollout-policy weights (the transformer's state dict, or
    with ``options.lora`` the adapter)."""
    try:
        import ray
    except ImportError:
        raise InvalidRequest("options.orchestration", "'ray' needs Ray installed (pip install ray)", allowed=["local"]) from None
    o = method.options
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=max(2, o.rollout_workers + 1), include_dashboard=False, log_to_driver=False)  # type: ignore[attr-defined]
    source = run.instance.options.source
    card_json = method.rollout_card(run.card).model_dump_json()
    worker_cls = ray.remote(num_cpus=0)(RolloutWorker)
    learner_cls = ray.remote(num_cpus=0)(LearnerActor)
    workers = [worker_cls.remote(card_json, source) for _ in range(o.rollout_workers)]  # type: ignore[attr-defined]
    learner = learner_cls.remote(method, run.card.model_dump_json(), source, run.recipe.seed)
    try:
        async def go() -> Any:
            backend = RayBackend(workers)
            if o.lora is None:  # (with LoRA, run_epochs sends the first adapter and checks the rollouts')
                await backend.load(await learner.weights.remote())  # every worker starts from the learner's theta_old
            await method.run_epochs(run, backend, reward, _RemoteLearner(learner), history)
            return await learner.weights.remote()

        return run_blocking(go())
    finally:
        ray.get([w.shutdown.remote() for w in workers])
        for actor in (*workers, learner):
            ray.kill(actor)
        if started_here:
            ray.shutdown()
