"""Adapters in the engine: mixed stacks in one batched forward, merged runs priced by the cost
model, admission's reservation and pins, and adapter loads as scheduled ``cache_io`` units."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save

from fv_kernel.cache.adapters import AdapterRegistry, AdapterSettings
from fv_kernel.card.spec import AdapterRef
from fv_kernel.model.adapters import convert_peft
from fv_kernel.model.instance import ADAPTER_LOAD_COST, ModelInstance, build_instance
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.blocking import run_blocking
from fv_kernel.runtime.cost import CostModel
from fv_kernel.runtime.engine import Engine, run_concurrently, run_serially
from fv_kernel.runtime.executor import MergePolicy
from fv_kernel.runtime.metrics import EngineMetrics
from fv_kernel.runtime.pricing import adapter_load_key
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.testing.adapters import peft_lora_tensors, write_peft_lora
from fv_kernel.testing.batching import StepRecorder, run_staggered
from fv_kernel.testing.interleave_kit import AdapterInterleaveConformance
from fv_kernel.testing.toy import build_component, toy_card

DIT_TARGETS = ("blocks.0.qkv", "blocks.1.mlp.0", "proj_out")


def lora(tmp: Path, name: str, *, seed: int, component: str = "dit", targets: tuple[str, ...] = DIT_TARGETS) -> Path:
    module = build_component(component, 1)
    return write_peft_lora(tmp / f"{name}.safetensors", peft_lora_tensors(module, component, targets, seed=seed, std=0.3))


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    lora(tmp_path, "style", seed=0)
    lora(tmp_path, "sketch", seed=1)
    lora(tmp_path, "words", seed=2, component="lm", targets=("qkv.0", "out.1"))
    return tmp_path


def engine(files: Path, *, batching: str = "throughput", merge: str = "never", **settings: Any) -> Engine:
    registry = AdapterRegistry(convert_peft, AdapterSettings(merge=merge, **settings))  # type: ignore[arg-type]
    registry.scan(files)
    eng = Engine(SchedulerConfig(device_thread=False, batching=batching), adapters=registry)  # type: ignore[arg-type]
    eng.add_instance(build_instance(toy_card("toy-dit")))
    return eng


def t2v(*adapters: AdapterRef, seed: int = 0, steps: int = 4, exact: bool = False) -> Request:
    # The toy's unipc loop runs a step's CFG rows in one forward (its euler loop runs them one by one).
    return Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),), adapters=adapters,
                   diffusion=DiffusionParams(seed=seed, steps=steps, sampler="unipc"), exact=exact)


MIXED = [
    t2v(AdapterRef(name="style"), seed=1),
    t2v(AdapterRef(name="sketch", scale=0.7), seed=1),
    t2v(seed=1),
    t2v(AdapterRef(name="style", scale=0.5), AdapterRef(name="words"), seed=1),
]


def frames(results: list[Any]) -> list[torch.Tensor]:
    return [r.raise_for_status().artifact("video").frames for r in results]


def test_mixed_stacks_share_fused_forwards_and_equal_each_request_alone(files: Path) -> None:
    together_engine = engine(files)
    together = frames(run_concurrently(together_engine, MIXED))
    assert max(together_engine.metrics.fused_calls_by_size, default=0) >= 3  # different stacks, one call
    alone = frames(run_serially(engine(files), MIXED))
    for got, want in zip(together, alone):
        assert (got - want).abs().max().item() <= 1e-6  # the toy card's batched_vs_alone tolerance
    assert all(not torch.allclose(together[2], other, atol=1e-3) for i, other in enumerate(together) if i != 2)


def test_exact_batching_is_bit_identical_with_mixed_stacks(files: Path) -> None:
    together = frames(run_concurrently(engine(files, batching="exact"), MIXED))
    alone = frames(run_serially(engine(files, batching="exact"), MIXED))
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def test_a_shuffled_row_map_is_caught(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alone = frames(run_serially(engine(files), MIXED))
    original = ModelInstance.row_adapters

    def shuffled(self: ModelInstance, inputs: Any, component: str) -> Any:
        ids = inputs.get("adapter_ids")
        if ids is not None and ids.shape[0] > 1:
            inputs = {**inputs, "adapter_ids": ids.flip(0), "adapter_scales": inputs["adapter_scales"].flip(0)}
        return original(self, inputs, component)

    monkeypatch.setattr(ModelInstance, "row_adapters", shuffled)
    together = frames(run_concurrently(engine(files), MIXED))
    assert max((got - want).abs().max().item() for got, want in zip(together, alone)) > 1e-3


def test_a_long_run_of_one_stack_merges_and_another_stack_restores_the_weights(files: Path) -> None:
    eng = engine(files, merge="auto")
    inst = eng.instances["toy-dit"]
    dit = inst.component("dit")
    base = {k: v.clone() for k, v in dit.state_dict().items()}
    styled = frames(run_serially(eng, [t2v(AdapterRef(name="style"), steps=12)]))[0]
    assert eng.metrics.adapter_transitions == 1 and inst.merged_stack("dit") is not None
    per_row = frames(run_serially(engine(files, merge="never"), [t2v(AdapterRef(name="style"), steps=12)]))[0]
    assert (styled - per_row).abs().max().item() <= 1e-5  # merged differs from per row by rounding only
    plain = frames(run_serially(eng, [t2v(steps=12)]))[0]
    assert inst.merged_stack("dit") is None and all(torch.equal(base[k], v) for k, v in dit.state_dict().items())
    assert torch.equal(plain, frames(run_serially(engine(files), [t2v(steps=12)]))[0])
    key_samples = [k for k in eng.cost_model.snapshot() if k["kind"] == "adapter_merge"]
    assert key_samples and all(k["samples"] >= 1 for k in key_samples)  # transitions calibrate the merge price


def test_merge_policy_is_rent_or_buy_on_the_cost_models_prices() -> None:
    cost, metrics = CostModel(), EngineMetrics()
    policy = MergePolicy(cost, metrics)
    inst = SimpleNamespace(instance_id="i")
    merge_price = policy.merge_price(inst, 1000)  # type: ignore[arg-type]
    step = SimpleNamespace(price_seconds=merge_price)  # one forward costs one merge; its updates a tenth of it
    gate = policy.gate(inst, [step], allow=True)  # type: ignore[arg-type,list-item]
    a, b = (("va", 1.0),), (("vb", 1.0),)
    decisions = [gate.should_merge(inst, "dit", a, 0.1, 1000) for _ in range(20)]  # type: ignore[arg-type]
    assert decisions.index(True) == 19  # 20 forwards of updates = merge + unmerge
    for _ in range(10):
        gate.should_merge(inst, "dit", a, 0.1, 1000)  # type: ignore[arg-type]
    gate.note_mixed(inst, "dit")  # type: ignore[arg-type]
    assert not any(gate.should_merge(inst, "dit", a, 0.1, 1000) for _ in range(19))  # type: ignore[arg-type]
    assert not gate.should_merge(inst, "dit", b, 0.1, 1000)  # type: ignore[arg-type]  # another stack: a new run
    gate.note_transition(inst, "dit", 1000, merge_price * 10)  # type: ignore[arg-type]  # measured: 10x dearer
    assert policy.merge_price(inst, 1000) > 5 * merge_price and metrics.adapter_transitions == 1  # type: ignore[arg-type]


def test_exact_requests_and_merge_never_keep_stacks_per_row(files: Path) -> None:
    exact = engine(files, merge="auto")
    got = frames(run_serially(exact, [t2v(AdapterRef(name="style"), steps=12, exact=True)]))[0]
    assert exact.metrics.adapter_transitions == 0
    want = frames(run_serially(engine(files, merge="never"), [t2v(AdapterRef(name="style"), steps=12, exact=True)]))[0]
    assert torch.equal(got, want)
    never = engine(files, merge="never")
    frames(run_serially(never, [t2v(AdapterRef(name="style"), steps=12)]))
    assert never.metrics.adapter_transitions == 0


def test_loads_are_priced_cache_io_units_run_once_per_device(files: Path) -> None:
    eng = engine(files)
    inst = eng.instances["toy-dit"]
    registry = inst.adapters
    assert registry is not None
    request, plain = eng.validate(t2v(AdapterRef(name="style"))), eng.validate(t2v())
    style = registry.get("style")
    cold = eng.reservation_for(request)
    assert cold.adapters == {style.version: style.weight_bytes}
    load_price = eng.cost_model.conservative(adapter_load_key(inst, style.weight_bytes), ADAPTER_LOAD_COST)
    assert cold.gpu_seconds == pytest.approx(eng.reservation_for(plain).gpu_seconds + load_price)
    results = run_concurrently(eng, [t2v(AdapterRef(name="style"), seed=s) for s in range(3)])
    assert all(r.status == "completed" for r in results)
    assert eng.metrics.units_by_kind.get("cache_io") == 1 and registry.stats()["cpu"].loads == 1  # one shared load
    assert registry.resident(style.version, "cpu") and registry.pinned(style.version, "cpu") == 0
    assert eng.cost_model.samples(adapter_load_key(inst, style.weight_bytes)) == 1  # the profiler timed it
    # A resident adapter's load is not priced again.
    assert eng.reservation_for(request).gpu_seconds == pytest.approx(eng.reservation_for(plain).gpu_seconds)


def test_admission_holds_a_request_whose_adapters_do_not_fit_beside_the_running_ones(files: Path) -> None:
    one = AdapterRegistry(convert_peft).add_file(files / "style.safetensors").weight_bytes
    eng = engine(files, device_budget_bytes=one)
    results = run_concurrently(eng, [t2v(AdapterRef(name="style")), t2v(AdapterRef(name="sketch"))])
    assert [r.status for r in results] == ["completed", "completed"]
    assert eng.metrics.rejections.get("admission_adapter_memory", 0) >= 1  # the second waited for the first
    too_small = engine(files, device_budget_bytes=one // 2)
    result = run_concurrently(too_small, [t2v(AdapterRef(name="style"))])[0]
    assert result.status == "failed" and result.error is not None and result.error.param == "adapters"
    assert "adapters.device_budget_bytes" in result.error.message


def test_a_load_runs_between_another_requests_steps(files: Path) -> None:
    recorder = StepRecorder()
    registry = AdapterRegistry(convert_peft, AdapterSettings(merge="never"))
    registry.scan(files)
    eng = Engine(SchedulerConfig(device_thread=False), adapters=registry, observers=[recorder])
    eng.add_instance(build_instance(toy_card("toy-dit")))
    # The first request runs long enough that the second's load (submitted after its 3rd step) lands mid-way
    # even when a loaded machine delays the submission by several of its steps.
    first, second = t2v(steps=24, seed=1), t2v(AdapterRef(name="sketch"), steps=8, seed=2)
    results = run_staggered(eng, [first, second], loop_id="denoise_unipc", offset=3)
    assert [r.status for r in results] == ["completed", "completed"]
    kinds = [(r.kind, r.request_ids) for r in recorder.records]
    load = next(i for i, (kind, _) in enumerate(kinds) if kind == "cache_io")
    steps_of_first = [i for i, (kind, ids) in enumerate(kinds) if kind == "diffusion_step" and first.request_id in ids]
    assert steps_of_first[0] < load < steps_of_first[-1]  # the first request kept stepping around the load


def test_a_weight_sync_unmerges_first_so_the_new_weights_stay(files: Path) -> None:
    eng = engine(files, merge="auto")
    inst = eng.instances["toy-dit"]
    frames(run_serially(eng, [t2v(AdapterRef(name="style"), steps=12)]))
    assert inst.merged_stack("dit") is not None
    new = {k: v.clone() for k, v in build_component("dit", 7).state_dict().items()}

    async def sync_then_plain() -> None:
        async with eng.running():
            await eng.sync_weights("toy-dit", lambda instance: instance.component("dit").load_state_dict(new))
            await eng.generate_async(t2v())  # a forward without the stack: it would restore what was merged

    run_blocking(sync_then_plain())
    assert inst.merged_stack("dit") is None
    assert all(torch.equal(new[k], v) for k, v in inst.component("dit").state_dict().items())


class TestToyAdapterInterleave(AdapterInterleaveConformance):
    """The interleave gate on the toy card, with a DiT adapter, none, and a DiT + text-encoder stack."""

    card_ids = ("toy-dit",)
    steps = 2
    adapter_stacks = ((AdapterRef(name="style"),), (), (AdapterRef(name="sketch", scale=0.7), AdapterRef(name="words")))

    def load_card(self, model_id: str) -> Any:
        return toy_card(model_id)

    def adapter_registry(self, cards: Any) -> AdapterRegistry:
        registry = AdapterRegistry(convert_peft)
        dit, lm = build_component("dit", 1), build_component("lm", 0)
        for name, module, component, targets, seed in (("style", dit, "dit", DIT_TARGETS, 0),
                                                       ("sketch", dit, "dit", DIT_TARGETS, 1),
                                                       ("words", lm, "lm", ("qkv.0", "out.1"), 2)):
            data = save(peft_lora_tensors(module, component, targets, seed=seed, std=0.3))
            registry.add_bytes(f"{name}.safetensors", data)
        return registry


def test_text_generation_applies_lm_adapters_per_request(files: Path) -> None:
    def chat(*adapters: AdapterRef) -> Request:
        from fv_kernel.request.request import ARParams

        return Request(model="toy-lm", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="hello"),), adapters=adapters,
                       ar=ARParams(max_tokens=6, temperature=0.0))

    def lm_engine(batching: str) -> Engine:
        registry = AdapterRegistry(convert_peft, AdapterSettings(merge="never"))
        registry.scan(files)
        eng = Engine(SchedulerConfig(device_thread=False, batching=batching), adapters=registry)  # type: ignore[arg-type]
        eng.add_instance(build_instance(toy_card("toy-lm")))
        return eng

    requests = [chat(AdapterRef(name="words", scale=3.0)), chat()]
    together = run_concurrently(lm_engine("exact"), requests)
    alone = run_serially(lm_engine("exact"), requests)
    tokens = [r.raise_for_status().artifact("text").token_ids for r in together]  # type: ignore[union-attr]
    assert tokens == [r.raise_for_status().artifact("text").token_ids for r in alone]  # type: ignore[union-attr]
    # The adapter is applied: the hidden states of its prefill differ from the plain one's.
    eng = lm_engine("exact")
    inst = eng.instances["toy-lm"]
    inst.load_for_task(TaskType.TEXT_GENERATION)
    words = eng.validate(requests[0])
    ids = torch.tensor([[104, 105]])
    plain = inst.op("lm_prefill").fn({"ids": ids, **inst.adapter_inputs(eng.validate(requests[1]), "lm")}, {})
    adapted = inst.op("lm_prefill").fn({"ids": ids, **inst.adapter_inputs(words, "lm")}, {})
    assert not torch.allclose(plain["logits"], adapted["logits"], atol=1e-4)


def test_an_adapter_for_a_module_the_model_lacks_fails_before_any_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked against the loaded model when it is staged: the request fails naming the entries and
    runs no step; a request beside it completes."""
    module = build_component("dit", 1)
    tensors = peft_lora_tensors(module, "dit", ["proj_out"], seed=3)
    tensors = {k.replace("dit.proj_out", "dit.blocks.9.qkv"): v for k, v in tensors.items()}  # the toy has 2 blocks
    write_peft_lora(tmp_path / "bigger.safetensors", tensors)
    lora(tmp_path, "style", seed=0)

    def run() -> tuple[list[Any], StepRecorder]:
        recorder = StepRecorder()
        registry = AdapterRegistry(convert_peft, AdapterSettings(merge="never"))
        registry.scan(tmp_path)  # registered: its keys are in the PEFT layout, the model is not loaded yet
        eng = Engine(SchedulerConfig(device_thread=False), adapters=registry, observers=[recorder])
        eng.add_instance(build_instance(toy_card("toy-dit")))
        return run_concurrently(eng, [bad, good]), recorder

    bad, good = t2v(AdapterRef(name="bigger"), seed=1), t2v(AdapterRef(name="style"), seed=2)
    results, recorder = run()
    assert [r.status for r in results] == ["failed", "completed"]
    assert "blocks.9.qkv" in results[0].error.message and "bigger" in results[0].error.message
    assert not [r for r in recorder.records if r.kind != "cache_io" and bad.request_id in r.request_ids]
    # Negative control: without the check at staging, the request runs steps before its forward finds the key.
    from fv_kernel.compute import lora as lora_module

    real_check = lora_module.AdapterWeights.check
    calls = {"staging": True}

    def check_after_staging(self: Any, root: Any) -> None:
        if calls["staging"]:
            return
        real_check(self, root)

    monkeypatch.setattr(lora_module.AdapterWeights, "check", check_after_staging)
    original_pin = Engine._stage_adapters

    async def staged(self: Engine, record: Any, versions: list[str]) -> None:
        calls["staging"] = True
        try:
            await original_pin(self, record, versions)
        finally:
            calls["staging"] = False

    monkeypatch.setattr(Engine, "_stage_adapters", staged)
    bad, good = t2v(AdapterRef(name="bigger"), seed=1), t2v(AdapterRef(name="style"), seed=2)
    results, recorder = run()
    assert results[0].status == "failed"
    assert [r for r in recorder.records if r.kind != "cache_io" and bad.request_id in r.request_ids]
