"""LoRA for the RL methods (fv_rl.lora): step 0 is the base, only A/B train, and the adapter-only
weight sync gives the rollout engine exactly the learner's function, with the rollouts' weights
version checked against the adapter the learner sent."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fv_rl.grpo import FlowGRPO, GRPOOptions, rollout_card
from fv_rl.lora import (
    DEFAULT_TARGETS,
    AdapterSlot,
    LoraOptions,
    LoraWeights,
    StaleRollout,
    check_rollout_versions,
    sharing_clone,
    target_paths,
)
from fv_rl.nft import DiffusionNFT, NFTOptions
from fv_rl.online import Learner, LocalBackend, as_input
from fv_rl.rollout import Rollout
from rl_helpers import engine_for, host, request, tiny_instance

from fv_kernel.api import (
    CardCatalog,
    ComputeOptions,
    InstanceOptions,
    InvalidRequest,
    RecipeError,
    TrainingRecipe,
    build_instance,
)
from fv_kernel.training.recipe import parse_options

LORA = LoraOptions(rank=4, alpha=8.0)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, 2, 4, 4, generator=g), torch.tensor([700.0, 300.0]), torch.randn(2, 8, 32, generator=g)


def _trained(weights: LoraWeights, seed: int = 1) -> None:
    """A/B as after some training: B no longer zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for up in weights.up:
            up.copy_(0.05 * torch.randn(up.shape, generator=g))


def test_default_targets_are_every_attention_and_ffn_linear_of_the_blocks():
    transformer = tiny_instance().component("transformer")
    paths = target_paths(transformer, DEFAULT_TARGETS)
    per_block = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
                 "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    assert paths == [f"blocks.{b}.{m}" for b in range(2) for m in per_block]  # not proj_out, not the embedders


def test_step_zero_lora_is_the_base_bit_for_bit_and_a_trained_b_is_not():
    transformer = tiny_instance().component("transformer")
    paths = target_paths(transformer, DEFAULT_TARGETS)
    weights = LoraWeights(transformer, paths, 4, 8.0, torch.Generator().manual_seed(0))
    assert all(d.abs().max() > 0 for d in weights.down) and all(torch.equal(u, torch.zeros_like(u)) for u in weights.up)
    view = sharing_clone(transformer)
    AdapterSlot(view, paths).set(weights.adapter("policy", "live"))
    x, t, ctx = _inputs()
    with torch.no_grad():
        base = transformer(x, t, ctx)
        assert torch.equal(view(x, t, ctx), base)
        _trained(weights)  # negative control: the same slot, B trained
        assert not torch.allclose(view(x, t, ctx), base, atol=1e-4)
        assert torch.equal(transformer(x, t, ctx), base)  # the clone's adapter never touches the shared module


def _rollouts(instance, capture: str, seeds=(0, 1), steps: int = 3) -> list[Rollout]:
    engine = engine_for(instance)
    from rl_helpers import run

    results = run(engine, [request(seed=s, capture=capture, steps=steps) for s in seeds])
    return [Rollout(prompt="a red fox", seed=s, record=r.artifact("behavior"), video=torch.zeros(1), request_id=str(s))
            for s, r in zip(seeds, results)]


@pytest.mark.parametrize("method_name", ["nft", "grpo"])
def test_an_update_trains_only_the_adapter_the_base_stays_bit_identical(method_name):
    if method_name == "nft":
        method = DiffusionNFT(NFTOptions(lora=LORA, lr=1e-2, kl_weight=1e-4, inner_steps=2))
        instance = tiny_instance()
        rollouts = _rollouts(instance, "final")
    else:
        method = FlowGRPO(GRPOOptions(lora=LORA, lr=1e-2, kl_weight=1e-3, inner_steps=2))
        instance = tiny_instance(rollout_card(CardCatalog(host()).get("wan-tiny"), 0.7, None))
        rollouts = _rollouts(instance, "steps")
    transformer = instance.component("transformer")
    base = {k: v.clone() for k, v in transformer.state_dict().items()}
    learner = Learner(method, transformer, seed=0, owns_old=True)
    down0 = [d.detach().clone() for d in learner.lora.down]
    assert learner.ref is not None  # KL on: theta_ref is the base, no copy of its weights
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(learner.ref.parameters(), transformer.parameters()))
    assert [id(p) for p in learner.optimizer.param_groups[0]["params"]] == [id(p) for p in learner.lora.parameters()]
    _logged, payload = learner.update(rollouts, torch.tensor([1.0, -1.0]), epoch=1)
    assert all(torch.equal(base[k], v) for k, v in transformer.state_dict().items())  # base bit-identical
    assert all(p.grad is None for p in transformer.parameters())
    assert any(u.detach().abs().max() > 0 for u in learner.lora.up)  # B moved off zero
    # A moved too (on the second step: while B is zero, A's gradient is zero, as in PEFT)
    assert any(not torch.equal(d0, d) for d0, d in zip(down0, learner.lora.down))
    # What a sync carries: theta_old's adapter alone, labelled with this run and epoch.
    assert set(payload.low_rank) == set(learner.lora.paths) and not payload.deltas and payload.version.endswith(".1")
    assert payload.nbytes < sum(t.numel() * t.element_size() for t in base.values())
    if method_name == "grpo":  # GRPO's theta_old is theta: the payload is the trained adapter itself
        assert all(torch.equal(payload.low_rank[p].up, u.detach()) for p, u in zip(learner.lora.paths, learner.lora.up))


def test_nft_old_adapter_is_the_ema_of_the_adapter_weights():
    method = DiffusionNFT(NFTOptions(lora=LORA, decay_rate=0.1, decay_max=0.5))
    transformer = tiny_instance().component("transformer")
    learner = Learner(method, transformer, seed=0, owns_old=True)
    _trained(learner.lora)
    new_old = method.after_epoch(learner.lora, learner.old_lora, epoch=3)  # d = 0.3
    torch.testing.assert_close(new_old.up[0], 0.3 * learner.old_lora.up[0] + 0.7 * learner.lora.up[0])


def _sync_and_sample(instance, learner: Learner, payload, capture: str, steps: int = 3, bump: bool = True):
    engine = engine_for(instance)
    backend = LocalBackend(engine, instance.model_id)

    async def go():
        async with engine.running():
            if not bump:  # negative control: a sync that keeps the old weights_version
                real = engine.sync_weights

                async def unbumped(model_id, load, *, version=None):
                    return await real(model_id, load, version=engine.instances[model_id].weights_version)

                engine.sync_weights = unbumped
            await backend.load(payload)
            results = [await engine.generate_async(request(seed=s, capture=capture, steps=steps)) for s in (0, 1)]
        return [Rollout(prompt="a red fox", seed=s, record=r.artifact("behavior"), video=torch.zeros(1), request_id=str(s))
                for s, r in zip((0, 1), results)]

    try:
        return asyncio.run(go()), backend
    finally:
        backend.close()


def _synced_learner(method, instance) -> tuple[Learner, object, object]:
    """A learner whose adapter has 'trained' (B random) and the payload a sync after it sends."""
    learner = Learner(method, instance.component("transformer"), seed=0, owns_old=False)
    stale = learner.weights()  # epoch 0: B = 0
    _trained(learner.lora)
    learner.old_lora.copy_from(learner.lora)
    return learner, learner._payload(1), stale


def test_adapter_sync_gives_the_rollout_engine_exactly_the_learners_function():
    instance = tiny_instance()
    transformer = instance.component("transformer")
    base = {k: v.clone() for k, v in transformer.state_dict().items()}
    learner, payload, _stale = _synced_learner(DiffusionNFT(NFTOptions(lora=LORA)), instance)
    rollouts, _ = _sync_and_sample(instance, learner, payload, "steps")
    check_rollout_versions(rollouts, payload.version)
    for ro in rollouts:
        record = ro.record
        assert record.weights_version == f"seeded:wan-tiny+lora-{payload.version}"
        for s in record.steps:  # the learner's forward with grad reproduces every rollout velocity bit for bit
            v = learner.policy(as_input(s.latents), as_input(record.timesteps[s.step].reshape(1)), as_input(record.prompt_embeds))
            assert v.requires_grad and torch.equal(v.detach().float(), s.velocity)
    assert all(torch.equal(base[k], v) for k, v in transformer.state_dict().items())  # the sync moved no base weight
    assert not transformer.blocks[0].attn1.to_q._forward_hooks  # the backend took its slot off when closed


def test_negative_control_a_stale_adapter_changes_the_function_and_the_version_check_catches_it():
    instance = tiny_instance()
    learner, payload, stale = _synced_learner(DiffusionNFT(NFTOptions(lora=LORA)), instance)
    rollouts, _ = _sync_and_sample(instance, learner, stale, "steps")  # the sync sent last epoch's adapter
    record = rollouts[0].record
    s = record.steps[0]
    v = learner.policy(as_input(s.latents), as_input(record.timesteps[0].reshape(1)), as_input(record.prompt_embeds))
    assert not torch.equal(v.detach().float(), s.velocity)
    with pytest.raises(StaleRollout, match=payload.version):
        check_rollout_versions(rollouts, payload.version)


def test_negative_control_a_sync_without_a_version_bump_is_caught():
    instance = tiny_instance()
    learner, payload, _ = _synced_learner(DiffusionNFT(NFTOptions(lora=LORA)), instance)
    rollouts, _ = _sync_and_sample(instance, learner, payload, "final", bump=False)
    assert rollouts[0].record.weights_version == "seeded:wan-tiny"
    with pytest.raises(StaleRollout, match="did not reach the rollout engine"):
        check_rollout_versions(rollouts, payload.version)


def test_grpo_lora_rollouts_replay_with_ratio_exactly_one():
    """C2 through the adapter sync: Flow-GRPO's recomputed log-probs equal the captured ones."""
    method = FlowGRPO(GRPOOptions(lora=LORA))
    instance = tiny_instance(rollout_card(CardCatalog(host()).get("wan-tiny"), 0.7, None))
    learner, payload, _ = _synced_learner(method, instance)
    rollouts, _ = _sync_and_sample(instance, learner, payload, "steps", steps=4)
    logged = method.update(learner.policy, learner.old, None, rollouts, torch.tensor([1.0, -1.0]), torch.Generator())
    assert logged["ratio_max_dev"] == 0.0
    # negative control: the base function (an untrained adapter, B = 0) is off-policy for these rollouts
    transformer = instance.component("transformer")
    base_view = sharing_clone(transformer)
    untrained = LoraWeights(transformer, learner.lora.paths, 4, 8.0, torch.Generator().manual_seed(0))
    AdapterSlot(base_view, learner.lora.paths).set(untrained.adapter("base", "live"))
    logged = method.update(base_view, learner.old, None, rollouts, torch.tensor([1.0, -1.0]), torch.Generator())
    assert logged["ratio_max_dev"] > 1e-4


def test_lora_options_errors_name_the_field():
    recipe = TrainingRecipe(method="nft", card="wan-tiny", output_model_id="x", options={"lora": {"rank": 0}})
    with pytest.raises(RecipeError, match=r"options\.lora\.rank"):
        parse_options(recipe, NFTOptions)
    recipe = TrainingRecipe(method="nft", card="wan-tiny", output_model_id="x", options={"lora": {"rank": 4, "dropout": 0.1}})
    with pytest.raises(RecipeError, match=r"options\.lora\.dropout"):
        parse_options(recipe, NFTOptions)
    transformer = tiny_instance().component("transformer")
    with pytest.raises(InvalidRequest, match=r"options\.lora\.target_modules: 'blocks\.\*\.attn3\*' matches no linear.*allowed: "):
        target_paths(transformer, ("blocks.*.attn1.*", "blocks.*.attn3*"))


def test_a_cuda_graph_rollout_instance_is_refused():
    h = host()
    card = CardCatalog(h).get("wan-tiny")
    instance = build_instance(card, InstanceOptions(device="cpu", precision="fp32", registry=h.registry(),
                                                    compute=ComputeOptions(cuda_graphs=True)))
    learner = Learner(DiffusionNFT(NFTOptions(lora=LORA)), instance.component("transformer"), seed=0, owns_old=False)
    with pytest.raises(InvalidRequest, match="CUDA graphs"):
        AdapterSlot.for_rollouts(instance, learner.weights())


def test_an_adapter_outside_the_slot_is_refused():
    transformer = tiny_instance().component("transformer")
    attn = target_paths(transformer, ("blocks.*.attn1.*",))
    slot = AdapterSlot(sharing_clone(transformer), attn)
    other = LoraWeights(transformer, target_paths(transformer, ("blocks.*.ffn.*",)), 2, 2.0, torch.Generator().manual_seed(0))
    from fv_kernel.api import AdapterError

    with pytest.raises(AdapterError, match="outside"):
        slot.set(other.adapter("ffn", "1"))
    assert slot.adapter is None  # the refused adapter was not installed; an attention one is
    slot.set(LoraWeights(transformer, attn, 2, 2.0, torch.Generator()).adapter("attn", "1"))


def test_the_sync_copies_the_adapter_onto_the_instances_device_and_dtype():
    instance = tiny_instance()
    transformer = instance.component("transformer")
    learner = Learner(DiffusionNFT(NFTOptions(lora=LORA)), transformer, seed=0, owns_old=False)
    payload = learner.weights()
    slot = AdapterSlot.for_rollouts(instance, payload)
    try:
        transformer.half()  # an instance served in another dtype than the learner's fp32 adapter
        slot.loader(payload)(instance)
        installed = slot.adapter.low_rank[learner.lora.paths[0]]
        sent = payload.low_rank[learner.lora.paths[0]]
        assert installed.down.dtype == torch.float16 and installed.down.data_ptr() != sent.down.data_ptr()
        assert slot.adapter.version == payload.version
    finally:
        slot.remove()


def test_a_run_whose_sync_does_not_reach_the_engine_stops_with_stale_rollout(tmp_path, monkeypatch):
    """Negative control of the loop's own check: a sync that keeps the old weights_version."""
    from fv_kernel.api import Engine, TrainingRun

    real = Engine.sync_weights

    async def unbumped(self, model_id, load, *, version=None):
        return await real(self, model_id, load, version=self.instances[model_id].weights_version)

    monkeypatch.setattr(Engine, "sync_weights", unbumped)
    card = CardCatalog(host()).get("wan-tiny")
    options = NFTOptions(lora=LORA, prompts=("a red fox",), group_size=2, epochs=1, steps=2, height=32, width=32, frames=5,
                         eval_seeds=(5,))
    recipe = TrainingRecipe(method="nft", card="wan-tiny", output_model_id="x", device="cpu")
    run = TrainingRun(recipe=recipe, options=options, card=card, instance=tiny_instance(card), device=torch.device("cpu"),
                      output=tmp_path, report=lambda *a: None)
    with pytest.raises(StaleRollout, match="did not reach the rollout engine"):
        DiffusionNFT(options).train(run)


def test_dmd2_lora_student_and_critic_are_adapters_on_the_one_teacher():
    from fv_rl.dmd2 import DMD2, DMD2Options

    teacher = tiny_instance().component("transformer").eval().requires_grad_(False)
    student, critic, student_params, critic_params, slot = DMD2(DMD2Options(lora=LORA))._views(teacher, seed=0)
    assert isinstance(student_params, LoraWeights) and isinstance(critic_params, LoraWeights)
    for view in (student, critic):
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(view.parameters(), teacher.parameters()))
    assert all(not p.requires_grad for p in teacher.parameters())
    assert slot is not None and slot.root is student
