"""LoRA adapters through fv-wan's loops and ops on the tiny cards (CPU, fp32).

Requests with different adapter stacks share batched forwards and still equal each request run
alone; text-encoder adapters are part of the embedding cache key; a Wan 2.2 step uses the
adapters of the expert it runs; a distilled adapter refuses another step count. Each check has
its negative control (a shuffled row→adapter map, a key without the adapters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fv_wan.instance
from fv_kernel.api import (
    AdapterRef,
    AdapterRegistry,
    AdapterSettings,
    DiffusionParams,
    Engine,
    GenerationResult,
    InvalidRequest,
    ModelInstance,
    RecipeMismatch,
    Request,
    RowAdapters,
    SchedulerConfig,
    TaskType,
    TextPart,
    build_instance,
    resolve_for_instance,
    rows_adapted,
    run_concurrently,
    run_serially,
)
from fv_kernel.testing import StepRecorder, assert_artifacts_identical
from fv_kernel.testing.interleave_kit import InterleaveConformance, artifacts_max_abs
from fv_wan.cards import wan_cards
from fv_wan.lora import convert_wan_lora
from wan_lora_files import wan_registry, write_wan_lora

STACKS: tuple[tuple[AdapterRef, ...], ...] = (
    (AdapterRef(name="style", scale=0.8),),
    (AdapterRef(name="sketch"), AdapterRef(name="ink", scale=0.5)),
    (),
)


def _card(model_id: str = "wan-tiny") -> Any:
    return next(c for c in wan_cards() if c.model_id == model_id)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> AdapterRegistry:
    return wan_registry(build_instance(_card()), tmp_path_factory.mktemp("loras"))


def _instance(registry: AdapterRegistry | None, model_id: str = "wan-tiny") -> ModelInstance:
    instance = build_instance(_card(model_id))
    instance.adapters = registry
    return instance


def _engine(registry: AdapterRegistry, batching: str = "exact", model_id: str = "wan-tiny") -> tuple[Engine, StepRecorder]:
    recorder = StepRecorder()
    engine = Engine(SchedulerConfig(batching=batching), observers=[recorder])  # type: ignore[arg-type]
    engine.add_instance(_instance(registry, model_id))
    return engine, recorder


def _request(i: int, adapters: tuple[AdapterRef, ...], *, prompt: str | None = None, model: str = "wan-tiny",
             steps: int = 3) -> Request:
    return Request(
        request_id=f"lora{i}-{len(adapters)}", model=model, task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text=prompt or f"a fox in the snow, take {i}"), TextPart(text="blurry", role="negative_prompt")),
        diffusion=DiffusionParams(seed=i, steps=steps, height=32, width=32, frames=5, guidance=5.0),
        adapters=adapters,
    )


def _alone(registry: AdapterRegistry, requests: list[Request]) -> list[GenerationResult]:
    """Each request through an Engine of its own on a fresh instance."""
    out = []
    for request in requests:
        engine, _ = _engine(registry)
        (result,) = run_serially(engine, [request])
        result.raise_for_status()
        out.append(result)
    return out


def _mixed() -> list[Request]:
    return [_request(i, stack) for i, stack in enumerate(STACKS)]


def test_adapters_change_the_video_and_none_changes_nothing(registry: AdapterRegistry) -> None:
    with_style = _alone(registry, [_request(0, STACKS[0])])[0]
    engine = Engine(SchedulerConfig())
    engine.add_instance(build_instance(_card()))  # a deployment without adapters
    (plain,) = run_serially(engine, [_request(0, ())])
    (empty_stack,) = _alone(registry, [_request(0, ())])
    assert artifacts_max_abs(with_style.artifacts, plain.artifacts) > 1e-2
    assert_artifacts_identical(plain.artifacts, empty_stack.artifacts, what="no adapters vs adapters off")


def test_mixed_adapter_batch_exact_mode_is_bit_identical_to_each_alone(registry: AdapterRegistry) -> None:
    requests = _mixed()
    reference = _alone(registry, requests)
    engine, _ = _engine(registry, "exact")
    for request, ref, got in zip(requests, reference, run_concurrently(engine, requests)):
        got.raise_for_status()
        assert_artifacts_identical(ref.artifacts, got.artifacts, what=f"{request.request_id} interleaved vs alone")


def _throughput(registry: AdapterRegistry, requests: list[Request]) -> tuple[list[GenerationResult], StepRecorder]:
    engine, recorder = _engine(registry, "throughput")
    results = run_concurrently(engine, requests)
    for result in results:
        result.raise_for_status()
    return results, recorder


def test_mixed_adapter_batch_throughput_mode_within_the_card_tolerance(registry: AdapterRegistry) -> None:
    requests = _mixed()
    reference = _alone(registry, requests)
    results, recorder = _throughput(registry, requests)
    fused = [r for r in recorder.of_kind("diffusion_step") if r.batch_size == len(requests)]
    assert fused, "the three requests' denoise steps must share forwards for the test to mean anything"
    tolerance = _card().parity.batching_tolerance("fp32").max_abs
    for request, ref, got in zip(requests, reference, results):
        assert artifacts_max_abs(ref.artifacts, got.artifacts) <= tolerance, request.request_id


def test_negative_control_shuffled_row_to_adapter_map_fails(registry: AdapterRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = _mixed()
    reference = _alone(registry, requests)
    real = fv_wan.instance.adapter_routing

    def shuffled(instance: Any, inputs: Any, component: str, rows: Any = None) -> RowAdapters | None:
        if "adapter_ids" not in inputs:
            return real(instance, inputs, component, rows)
        rolled = {k: inputs[k].roll(1, 0) for k in ("adapter_ids", "adapter_scales")}
        return real(instance, rolled, component, rows)

    monkeypatch.setattr(fv_wan.instance, "adapter_routing", shuffled)
    results, _ = _throughput(registry, requests)
    tolerance = _card().parity.batching_tolerance("fp32").max_abs
    assert max(artifacts_max_abs(r.artifacts, g.artifacts) for r, g in zip(reference, results)) > 100 * tolerance


def test_text_encoder_adapter_never_gets_a_cached_embedding_of_another_stack(registry: AdapterRegistry) -> None:
    prompt = "a fox in the snow"
    plain, with_te = _request(0, (), prompt=prompt), _request(1, (AdapterRef(name="sketch"),), prompt=prompt)
    with_te = with_te.model_copy(update={"diffusion": plain.diffusion})
    (alone,) = _alone(registry, [with_te])
    engine, recorder = _engine(registry)
    results = run_serially(engine, [plain, with_te])
    encodes = [r for r in recorder.of_kind("encoder_chunk") if r.op == "encode_text"]
    assert len(encodes) == 2, "the adapter's prompt must be encoded again"
    assert_artifacts_identical(alone.artifacts, results[1].artifacts, what="after another stack's cached embedding")


def test_a_transformer_only_adapter_shares_the_text_embedding_cache(registry: AdapterRegistry) -> None:
    prompt = "a fox in the snow"
    plain, styled = _request(0, (), prompt=prompt), _request(1, (AdapterRef(name="style"),), prompt=prompt)
    engine, recorder = _engine(registry)
    for result in run_serially(engine, [plain, styled]):
        result.raise_for_status()
    assert len([r for r in recorder.of_kind("encoder_chunk") if r.op == "encode_text"]) == 1


def test_negative_control_a_key_without_adapter_versions_serves_stale_embeddings(
    registry: AdapterRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = "a fox in the snow"
    plain, with_te = _request(0, (), prompt=prompt), _request(1, (AdapterRef(name="sketch"),), prompt=prompt)
    with_te = with_te.model_copy(update={"diffusion": plain.diffusion})
    (alone,) = _alone(registry, [with_te])
    real = ModelInstance.adapter_versions
    monkeypatch.setattr(
        ModelInstance, "adapter_versions",
        lambda self, request, component: () if component == "text_encoder" else real(self, request, component),
    )
    engine, _ = _engine(registry)
    results = run_serially(engine, [plain, with_te])
    assert artifacts_max_abs(alone.artifacts, results[1].artifacts) > 1e-3


def test_cfg_rows_of_a_request_carry_the_same_adapters(registry: AdapterRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, torch.Tensor]] = []
    real = fv_wan.instance.adapter_routing

    def spy(instance: Any, inputs: Any, component: str, rows: Any = None) -> RowAdapters | None:
        if rows is None and "adapter_ids" in inputs:
            seen.append((component, inputs["adapter_ids"].clone()))
        return real(instance, inputs, component, rows)

    monkeypatch.setattr(fv_wan.instance, "adapter_routing", spy)
    engine = Engine(SchedulerConfig())
    instance = build_instance(_card().model_copy(update={"loops": {
        k: (v.model_copy(update={"config": {**v.config, "cfg_dispatch": "batched"}}) if v.kind == "diffusion_denoise" else v)
        for k, v in _card().loops.items()}}))  # fmt: skip
    instance.adapters = registry
    engine.add_instance(instance)
    run_serially(engine, [_request(0, STACKS[1])])[0].raise_for_status()
    # prompt and negative prompt rows alike: sketch (text encoder and transformer) and ink (transformer only)
    assert [c for c, _ in seen] == ["text_encoder"] + ["transformer"] * 3
    for component, ids in seen:
        assert ids.shape == (2, 2) and torch.equal(ids[0], ids[1]), (component, ids)
        assert int((ids[0] >= 0).sum()) == (1 if component == "text_encoder" else 2), (component, ids)


def test_a_forward_with_adapters_skips_cuda_graph_replay(registry: AdapterRegistry) -> None:
    instance = _instance(registry)
    model = instance.component("transformer")
    replays: list[int] = []

    def graphs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        replays.append(batch["x"].shape[0])
        return {"v": model(batch["x"], batch["t"], batch["context"]).float()}

    op = fv_wan.instance._dit_op("transformer", model, graphs, instance=instance)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(0)
    base = {"x": torch.randn(2, 16, 2, 4, 4, generator=generator), "t": torch.tensor([900.0, 900.0]),
            "context": torch.randn(2, 16, 32, generator=generator)}  # fmt: skip
    request = resolve_for_instance(instance, _request(0, STACKS[0]))
    adapted = {**base, **instance.adapter_inputs(request, "transformer", rows=2)}
    none = {**base, **instance.adapter_inputs(resolve_for_instance(instance, _request(0, ())), "transformer", rows=2)}
    params = {"dispatch": "batched"}
    op.fn(none, params)
    assert replays == [2]
    out = op.fn(adapted, params)["v"]
    assert replays == [2], "a forward with adapters must not replay a graph (graphs capture no hooks)"
    with torch.no_grad(), rows_adapted(model, instance.row_adapters(adapted, "transformer")):
        expected = model(base["x"], base["t"], base["context"]).float()
    assert torch.equal(out, expected)


def test_wan22_step_uses_the_adapters_of_the_expert_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = build_instance(_card("wan-tiny-a14b"))
    registry = AdapterRegistry(convert_wan_lora, AdapterSettings(max_stack=2))
    registry.add_file(write_wan_lora(tmp_path / "high.safetensors", probe.component("transformer"), seed=4))
    registry.add_file(write_wan_lora(tmp_path / "low.transformer_2.safetensors", probe.component("transformer_2"), seed=5))
    assert registry.get("low.transformer_2").components == ("transformer_2",)
    used: list[tuple[str, frozenset[str]]] = []
    real = fv_wan.instance.adapter_routing

    def spy(instance: Any, inputs: Any, component: str, rows: Any = None) -> RowAdapters | None:
        routing = real(instance, inputs, component, rows)
        if component.startswith("transformer"):
            used.append((component, frozenset() if routing is None else frozenset(s.adapter.name for s in routing.segments)))
        return routing

    monkeypatch.setattr(fv_wan.instance, "adapter_routing", spy)
    engine, _ = _engine(registry, model_id="wan-tiny-a14b")
    stack = (AdapterRef(name="high"), AdapterRef(name="low.transformer_2", scale=0.7))
    run_serially(engine, [_request(0, stack, model="wan-tiny-a14b")])[0].raise_for_status()
    experts = {component for component, _ in used}
    assert experts == {"transformer", "transformer_2"}, "3 steps at shift 12 reach both experts"
    for component, names in used:
        assert names == ({"high"} if component == "transformer" else {"low.transformer_2"}), (component, names)


def test_distilled_adapter_with_another_step_count_is_a_recipe_mismatch(tmp_path: Path) -> None:
    instance = _instance(None)
    registry = AdapterRegistry(convert_wan_lora, AdapterSettings())
    registry.add_file(write_wan_lora(tmp_path / "lightning.safetensors", instance.component("transformer"),
                                     metadata={"fv.assumes_loop": "denoise", "fv.assumes_steps": "4"}))
    instance.adapters = registry
    info = registry.get("lightning")
    assert (info.assumes_loop, info.assumes_steps) == ("denoise", 4)
    with pytest.raises(RecipeMismatch, match="4"):
        resolve_for_instance(instance, _request(0, (AdapterRef(name="lightning"),), steps=50))
    resolve_for_instance(instance, _request(0, (AdapterRef(name="lightning"),), steps=4))


class TestWanInterleaveWithAdapters(InterleaveConformance):
    """The interleave gate on wan-tiny with every request carrying another adapter stack (one none)."""

    card_ids = ["wan-tiny"]
    steps = 3
    concurrency = 3

    @pytest.fixture(autouse=True)
    def _adapters(self, registry: AdapterRegistry) -> None:
        self._registry = registry

    def build(self, card: Any) -> ModelInstance:
        instance = super().build(card)
        instance.adapters = self._registry
        return instance

    def assert_requests_vary(self, cards: Any, requests: Any) -> None:
        # the kit resolves against the bare card, which knows no registry: check the other fields
        super().assert_requests_vary(cards, [r.model_copy(update={"adapters": ()}) for r in requests])

    def requests_for(self, card: Any, *, seeds: Any = (0,), prefix: str = "", vary_size: bool = False) -> list[Request]:
        requests = super().requests_for(card, seeds=seeds, prefix=prefix, vary_size=vary_size)
        return [r.model_copy(update={"adapters": STACKS[i % len(STACKS)]}) for i, r in enumerate(requests)]


def test_an_adapter_for_a_module_the_card_lacks_fails_naming_it(registry: AdapterRegistry, tmp_path: Path) -> None:
    """An I2V LoRA's image K projection on the T2V wan-tiny: the request fails with the key named."""
    own = AdapterRegistry(convert_wan_lora, AdapterSettings())
    from safetensors.torch import save_file

    save_file({"diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight": torch.ones(2, 24) * 0.1,
               "diffusion_model.blocks.0.cross_attn.k_img.lora_up.weight": torch.ones(24, 2) * 0.1},
              str(tmp_path / "i2v_only.safetensors"))  # fmt: skip
    own.add_file(tmp_path / "i2v_only.safetensors")
    engine, _ = _engine(own)
    (result,) = run_serially(engine, [_request(0, (AdapterRef(name="i2v_only"),))])
    assert result.status == "failed" and result.error is not None
    assert "blocks.0.attn2.add_k_proj" in result.error.message and "i2v_only" in result.error.message


def test_a_low_noise_expert_adapter_on_a_one_expert_card_is_refused(tmp_path: Path) -> None:
    instance = _instance(None)
    registry = AdapterRegistry(convert_wan_lora, AdapterSettings())
    registry.add_file(write_wan_lora(tmp_path / "low.transformer_2.safetensors", instance.component("transformer")))
    instance.adapters = registry
    with pytest.raises(InvalidRequest, match="transformer_2"):
        resolve_for_instance(instance, _request(0, (AdapterRef(name="low.transformer_2"),)))


def test_a_merged_stack_is_applied_once_not_again_per_row(registry: AdapterRegistry) -> None:
    """With the request's stack merged into the weights (the scheduler's fast path for a long run of
    one stack), the op runs the merged weights and adds nothing per row: the same result to rounding."""
    instance = _instance(registry)
    model = instance.component("transformer")
    op = fv_wan.instance._dit_op("transformer", model, instance=instance)
    # a strength fp32 holds exactly: the instance compares the merged stack with the step's fp32 scales
    stack = (AdapterRef(name="style", scale=0.75),)
    generator = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(2, 16, 2, 4, 4, generator=generator), "t": torch.tensor([700.0, 700.0]),
              "context": torch.randn(2, 16, 32, generator=generator),
              **instance.adapter_inputs(resolve_for_instance(instance, _request(0, stack)), "transformer", rows=2)}  # fmt: skip
    params = {"dispatch": "batched"}
    per_row = op.fn(inputs, params)["v"]
    instance.merge_stack("transformer", ((registry.get("style").version, 0.75),))
    try:
        merged = op.fn(inputs, params)["v"]
        # negative control: the stack added per row on top of the merged weights is far off
        style = registry.weights(registry.get("style").version, "transformer", "cpu")
        with torch.no_grad(), rows_adapted(model, RowAdapters.from_stacks([[(style, 0.75)]] * 2)):
            twice = model(inputs["x"], inputs["t"], inputs["context"]).float()
        assert (twice - per_row).abs().max() > 1e-2
    finally:
        instance.unmerge("transformer")
    assert (merged - per_row).abs().max() <= 1e-5
    assert torch.equal(op.fn(inputs, params)["v"], per_row)  # unmerged: the base weights back exactly
