"""Extension points: step and block interceptors with per-request state, NaNWatch, ParityAligner,
deploy-time conflict checks, card refusals and exact mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from fv_kernel.loop.samplers import FlowEulerSampler
from fv_kernel.model.instance import build_instance
from fv_kernel.card.spec import ModelCard
from fv_kernel.extend.hooks import ActiveInterceptor
from fv_kernel.extend.interceptors import BlockInterceptor, StepInterceptor
from fv_kernel.extend.observers import NaNWatch, ParityAligner
from fv_kernel.extend.registry import ExtensionConfigError, ExtensionSet, InterceptorRejected
from fv_kernel.errors import InvalidRequest
from fv_kernel.loop.plan import StepResult
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.engine import Engine, run_concurrently, run_serially
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.runtime.local import run_local
from fv_kernel.testing.card_kit import assert_artifacts_identical, roundtrip_state
from fv_kernel.testing.toy import toy_card


class ReuseParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    every: int = Field(default=2, ge=1)
    poison: bool = False


class ReuseMiddle(BlockInterceptor):
    """Always computes block 0; on every ``every``-th step reuses the cached residual of the rest."""

    plugin_id = "reuse-middle"
    request_model = ReuseParams

    def distribution_altering(self, params: BaseModel) -> bool:
        return params.every > 1  # type: ignore[attr-defined]

    def run_blocks(self, blocks, hidden, state, params, call):  # type: ignore[no-untyped-def]
        hidden = blocks.run(0, 1, hidden)
        if params.poison and call.step_index == 1:
            hidden = hidden * float("nan")
        state.setdefault("steps", []).append(call.step_index)
        if "residual" in state and call.step_index % params.every == 1:
            return hidden + state["residual"]
        out = blocks.run(1, blocks.num_blocks, hidden)
        state["residual"] = out - hidden
        return out


class SkipOddSteps(StepInterceptor):
    """Answers odd steps with the previous step's output (a step-skip cache)."""

    plugin_id = "skip-odd"
    request_model = ReuseParams

    def distribution_altering(self, params: BaseModel) -> bool:
        return True

    async def around_step(self, plan, state, params, call_next):  # type: ignore[no-untyped-def]
        step = plan.step_index or 0
        if step % 2 == 1 and "last" in state:
            return StepResult(outputs={"v": state["last"]})
        result = await call_next(plan)
        state["last"] = result.outputs["v"]
        return result


def t2v(i: int, *, model: str = "toy-dit", params: dict[str, Any] | None = None, **kw: Any) -> Request:
    return Request(
        request_id=f"r{i}-{kw.pop('tag', '')}", model=model, task=TaskType.TEXT_TO_VIDEO,
        inputs=(TextPart(text=f"prompt {i}"),), diffusion=DiffusionParams(seed=i, steps=5),
        plugin_params=params or {}, **kw,
    )


def engine(extensions: ExtensionSet, *cards: ModelCard) -> Engine:
    e = Engine(SchedulerConfig(device_thread=False, batching="exact"), extensions=extensions)  # these compare bit for bit
    for card in cards or (toy_card("toy-dit"),):
        e.add_instance(build_instance(card))
    return e


def reuse_set(**settings: Any) -> ExtensionSet:
    return ExtensionSet.build({"reuse-middle": settings}, {"reuse-middle": ReuseMiddle})


def test_no_extension_means_no_hooks_on_the_hot_path() -> None:
    e = engine(ExtensionSet())
    instance = e.instances["toy-dit"]
    assert e.hooks_for(instance, e.validate(t2v(0))) is None


def test_block_interceptor_state_is_per_request_and_per_branch() -> None:
    instance = build_instance(toy_card("toy-dit"))
    extensions = reuse_set()
    states = {}

    def capture(state):  # type: ignore[no-untyped-def]
        if state.loop_id == "denoise":
            states["last"] = state
        return None

    plain = run_local(t2v(0), instance)
    cached = run_local(t2v(0, params={"reuse-middle": {"every": 2}}), instance, extensions=extensions, on_state=capture)
    plugin_state = states["last"].plugin_state["reuse-middle"]
    assert set(plugin_state) == {"cond", "uncond"}, "CFG branches keep separate state"
    assert plugin_state["cond"]["steps"] == [0, 1, 2, 3, 4]
    assert not torch.equal(plain[0].frames, cached[0].frames), "reusing residuals changed the output"
    same = run_local(t2v(0, params={"reuse-middle": {"every": 1}}), instance, extensions=extensions)
    assert_artifacts_identical(plain, same, what="every=1 computes every block")


def test_interceptor_state_round_trips_with_the_loop_state() -> None:
    instance = build_instance(toy_card("toy-dit"))
    extensions = reuse_set()
    request = t2v(1, params={"reuse-middle": {"every": 2}})
    plain = run_local(request, instance, extensions=extensions)
    resumed = run_local(request, instance, extensions=extensions, on_state=roundtrip_state)
    assert_artifacts_identical(plain, resumed, what="interceptor state saved and restored")


def test_interleaved_requests_with_caching_equal_serial() -> None:
    requests = [t2v(i, params={"reuse-middle": {"every": 2}}) for i in range(3)]
    serial = run_serially(engine(reuse_set()), [r.with_updates(request_id=r.request_id + "s") for r in requests])
    e = engine(reuse_set())
    interleaved = run_concurrently(e, requests)
    assert max(e.metrics.batches_by_size) > 1
    for s, c in zip(serial, interleaved):
        assert c.status == "completed", c.error
        assert_artifacts_identical(s.artifacts, c.artifacts, what=c.request_id)


def test_default_on_interceptor_applies_without_request_params() -> None:
    e = engine(reuse_set(default_on=True))
    hooks = e.hooks_for(e.instances["toy-dit"], e.validate(t2v(0)))
    assert hooks is not None and hooks.block is not None and hooks.block.params == ReuseParams()


def test_step_interceptor_skips_steps() -> None:
    instance = build_instance(toy_card("toy-dit"))
    extensions = ExtensionSet.build({"skip-odd": {}}, {"skip-odd": SkipOddSteps})
    calls: list[float] = []
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    original = instance.op("dit_forward").fn

    def counting(inputs, params):  # type: ignore[no-untyped-def]
        calls.append(float(inputs["t"][0]))  # the per-sample timestep names the step
        return original(inputs, params)

    instance._ops["dit_forward"] = instance.op("dit_forward").__class__("dit_forward", counting)
    run_local(t2v(0, params={"skip-odd": {}}), instance, extensions=extensions)
    timesteps = FlowEulerSampler(shift=1.0).init_state(5).timesteps
    assert calls == [float(timesteps[i]) for i in (0, 2, 4)]


def _distilled() -> ModelCard:
    card = toy_card("toy-dit")
    loops = {k: v.model_copy(update={"rejects_interceptors": frozenset({"step_skip"})}) for k, v in card.loops.items()}
    data = card.model_dump()
    data.update(model_id="toy-distilled", loops=loops)
    return ModelCard.model_validate(data)


def test_a_distilled_card_refuses_step_skipping() -> None:
    extensions = ExtensionSet.build({"skip-odd": {}}, {"skip-odd": SkipOddSteps})
    e = engine(extensions, _distilled())
    with pytest.raises(InterceptorRejected) as info:
        e.validate(t2v(0, model="toy-distilled", params={"skip-odd": {}}))
    assert "refuses step_skip" in str(info.value) and info.value.param == "plugin_params.skip-odd"
    default_on = ExtensionSet.build({"skip-odd": {"default_on": True}}, {"skip-odd": SkipOddSteps})
    with pytest.raises(ExtensionConfigError, match="toy-distilled"):
        engine(default_on, _distilled())


def test_conflicting_interceptors_are_rejected_at_deploy_time() -> None:
    class OtherCache(ReuseMiddle):
        plugin_id = "other-cache"

    with pytest.raises(ExtensionConfigError, match="both wrap the block sequence"):
        ExtensionSet.build({"reuse-middle": {}, "other-cache": {}}, {"reuse-middle": ReuseMiddle, "other-cache": OtherCache})

    class Declared(SkipOddSteps):
        plugin_id = "declared"
        conflicts_with = frozenset({"skip-odd"})

    with pytest.raises(ExtensionConfigError, match="conflicts with 'skip-odd'"):
        ExtensionSet.build({"declared": {}, "skip-odd": {}}, {"declared": Declared, "skip-odd": SkipOddSteps})
    with pytest.raises(ExtensionConfigError, match="no enabled plugin provides it"):
        ExtensionSet.build({"missing": {}}, {})


def test_request_params_are_validated_and_exact_mode_refuses_altering_ones() -> None:
    e = engine(reuse_set())
    with pytest.raises(InvalidRequest) as info:
        e.validate(t2v(0, params={"not-enabled": {}}))
    assert "reuse-middle" in str(info.value)
    with pytest.raises(InvalidRequest, match="plugin_params.reuse-middle.every"):
        e.validate(t2v(0, params={"reuse-middle": {"every": 0}}))
    with pytest.raises(InvalidRequest, match="exact-mode"):
        e.validate(t2v(0, params={"reuse-middle": {"every": 2}}, exact=True))
    e.validate(t2v(0, params={"reuse-middle": {"every": 1}}, exact=True))


def test_nanwatch_names_the_block_and_aborts_only_that_request() -> None:
    extensions = reuse_set()
    extensions.observers.append(NaNWatch())
    e = engine(extensions)
    healthy = t2v(0, params={"reuse-middle": {"every": 1}})
    poisoned = t2v(1, params={"reuse-middle": {"every": 1, "poison": True}})
    results = run_concurrently(e, [healthy, poisoned])
    assert results[0].status == "completed"
    assert results[1].status == "failed" and results[1].error is not None
    message = results[1].error.message
    assert "step 1" in message and "after block 1" in message and "'cond'" in message
    [alone] = run_serially(engine(reuse_set()), [healthy.with_updates(request_id="alone")])
    assert_artifacts_identical(alone.artifacts, results[0].artifacts)


def test_parity_aligner_records_taps_and_reports_the_first_divergence() -> None:
    instance = build_instance(toy_card("toy-dit"))
    recorder = ParityAligner()
    extensions = ExtensionSet(observers=[recorder])
    run_local(t2v(0, tag="ref"), instance, extensions=extensions)
    reference = recorder.taps("r0-ref")
    assert "denoise/step0/cond/block0" in reference and "denoise/step4/uncond/block1" in reference
    comparer = ParityAligner(reference={k.replace("r0-ref", ""): v for k, v in reference.items()}, tolerance=1e-6)
    extensions = ExtensionSet(observers=[comparer])
    run_local(t2v(0, tag="same"), instance, extensions=extensions)
    assert comparer.first_divergence("r0-same") is None
    run_local(t2v(5, tag="other"), instance, extensions=extensions)
    divergence = comparer.first_divergence("r5-other")
    assert divergence is not None and divergence.tap == "denoise/step0/cond/block0" and divergence.max_abs_diff > 1e-6


def test_active_interceptor_exposes_its_plugin_id() -> None:
    active = ActiveInterceptor(ReuseMiddle(), ReuseParams())
    assert active.plugin_id == "reuse-middle"
