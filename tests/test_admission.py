"""Admission that really reserves (design §6.1-6.2, §7.2).

* budgets are on by default: memory sized from the device (total x (1 - headroom) minus
  what resident instances keep), overridable and switchable off in the deploy config;
* a reservation's compute comes from the calibrated cost model: after the Profiler sees
  slow steps, the next request reserves more (and a loop that prices itself from its
  static spec does not, the negative control);
* block pools are part of admission: a request waits until its blocks are free, so the
  loop's allocation never fails (and without the reservation it does);
* every toy loop's estimate describes the steps it runs, with their real shapes.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fv_kernel.cache.paged_kv import PagedKVConfig, PagedKVPool
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import ModelInstance, build_instance
from fv_kernel.config import DeployConfig, DeployConfigError, load_deploy_config
from fv_kernel.errors import CapacityError
from fv_kernel.extend.observers import Observer, StepRecord
from fv_kernel.loop.plan import ResourceRequest, ShapeSignature, StepEstimate, WorkKind
from fv_kernel.request.request import ARParams, DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime import capacity
from fv_kernel.runtime.admission import AdmissionController, Budgets, Reservation
from fv_kernel.runtime.cost import CostKey, CostModel
from fv_kernel.runtime.engine import Engine, run_concurrently, run_serially
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.testing.admission import assert_estimate_covers_execution
from fv_kernel.testing.batching import StepRecorder
from fv_kernel.testing.fake_pool import FakeState, FakeStepLoop, build_fake_instance, fake_card
from fv_kernel.testing.toy import toy_card
from fv_kernel.card.spec import StepCostSpec

DOCS = Path(__file__).resolve().parents[1] / "docs"


def video(i: int, *, steps: int = 4, model: str = "fake-video") -> Request:
    return Request(request_id=f"v{i}", model=model, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="x"),),
                   diffusion=DiffusionParams(steps=steps, seed=i))


# -- the deploy config: budgets on by default, overridable, switchable off --------------


def test_budgets_default_to_auto_memory_and_strict_keys(tmp_path: Path) -> None:
    assert SchedulerConfig().budgets.memory_bytes == "auto"
    assert Budgets().memory_headroom == 0.1
    assert Budgets(memory_bytes="40GiB").memory_bytes == 40 * 2**30
    assert Budgets(memory_bytes="1.5 GB").memory_bytes == 1_500_000_000
    assert Budgets(memory_bytes=None).memory_bytes == "unlimited", "null switches the memory budget off"
    path = tmp_path / "deploy.yaml"
    path.write_text("scheduler:\n  budgets:\n    memory: 5\n")
    with pytest.raises(DeployConfigError, match=r"scheduler\.budgets\.memory"):
        load_deploy_config(path)
    path.write_text("scheduler:\n  budgets:\n    memory_bytes: lots\n")
    with pytest.raises(DeployConfigError, match=r"scheduler\.budgets\.memory_bytes.*'lots' is not a size.*40GiB"):
        load_deploy_config(path)
    path.write_text("scheduler:\n  budgets:\n    memory_headroom: 1.5\n")
    with pytest.raises(DeployConfigError, match=r"memory_headroom"):
        load_deploy_config(path)


def test_serving_doc_deploy_reference_parses_and_states_the_defaults() -> None:
    text = (DOCS / "serving.md").read_text()
    block = re.search(r"## Deploy config reference.*?```yaml\n(.*?)```", text, re.S)
    assert block is not None
    config = DeployConfig.model_validate(yaml.safe_load(block.group(1)))
    assert config.scheduler.budgets == Budgets(), "the documented budgets are the defaults"


def _toy_engine(**budgets: object) -> tuple[Engine, ModelInstance]:
    engine = Engine(SchedulerConfig(device_thread=False, budgets=Budgets(**budgets)))
    instance = build_instance(toy_card("toy-dit"))
    engine.add_instance(instance)
    return engine, instance


def _t2v(i: int, **fields: object) -> Request:
    return Request(request_id=f"t{i}", model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="fox"),), **fields)


def test_auto_memory_budget_is_device_memory_less_headroom_less_resident_weights() -> None:
    engine, instance = _toy_engine(memory_headroom=0.25)
    usable = int(capacity.device_total_bytes("cpu") * 0.75)
    [result] = run_concurrently(engine, [_t2v(0)])
    assert result.status == "completed"
    assert engine.admission.memory_limit("cpu") == usable, "sized when no weights were loaded yet"
    weights = sum(capacity.module_bytes(c) for c in instance.components.values())
    assert weights > 0 and capacity.instance_resident_bytes(instance) == weights
    # Sized again when the next request queues: the weights loaded since now count.
    run_concurrently(engine, [_t2v(1)])
    assert engine.admission.memory_limit("cpu") == usable - weights


def test_auto_budget_rejects_what_can_never_fit_with_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "device_total_bytes", lambda device: 10_000)
    engine, _ = _toy_engine()
    need = engine.reservation_for(engine.validate(_t2v(0)))
    assert need.memory_bytes > 9_000, "the toy video needs more than the pretend device has"
    [result] = run_concurrently(engine, [_t2v(0)])
    assert result.status == "failed" and result.error is not None and result.error.type == "capacity"
    message = result.error.message
    assert f"needs {need.memory_bytes} bytes of memory on cpu" in message
    assert "the budget there is 9000 bytes (auto: 10000 bytes of cpu x (1 - memory_headroom 0.1)" in message
    # Negative control: the same engine with the memory budget switched off runs it.
    engine, _ = _toy_engine(memory_bytes="unlimited")
    [result] = run_concurrently(engine, [_t2v(0)])
    assert result.status == "completed" and engine.admission.memory_limit("cpu") is None


def test_an_explicit_memory_budget_is_used_as_is_on_every_device() -> None:
    engine, instance = _toy_engine(memory_bytes="1GiB")
    run_concurrently(engine, [_t2v(0)])
    assert capacity.instance_resident_bytes(instance) > 0
    assert engine.admission.memory_limit("cpu") == 2**30, "no weights subtracted from an explicit figure"


def test_an_unsizable_device_is_a_typed_error_at_add_instance() -> None:
    card = toy_card("toy-dit")
    engine = Engine(SchedulerConfig(device_thread=False))
    instance = build_instance(card)
    instance.options = instance.options.model_copy(update={"device": "meta"})
    with pytest.raises(CapacityError, match="set scheduler.budgets.memory_bytes"):
        engine.add_instance(instance)
    Engine(SchedulerConfig(budgets=Budgets(memory_bytes="1GiB"))).add_instance(instance)  # explicit: no sizing needed


# -- compute priced by the calibrated cost model --------------------------------------------


def _slow_fake_engine() -> Engine:
    # Declared 5 ms a step; each step really sleeps 50 ms.
    engine = Engine(SchedulerConfig(device_thread=False))
    engine.add_instance(build_instance(fake_card(step_seconds=0.005, cost_profile={1: 0.05})))
    return engine


def test_reservation_grows_after_the_profiler_sees_slow_steps() -> None:
    engine = _slow_fake_engine()
    before = engine.reservation_for(engine.validate(video(9, steps=10))).gpu_seconds
    assert before == pytest.approx(10 * 0.005), "uncalibrated: the declared spec (conservative factor 1)"
    run_serially(engine, [video(0, steps=3)])
    after = engine.reservation_for(engine.validate(video(9, steps=10))).gpu_seconds
    assert after >= 10 * 0.05 * 0.9, f"calibrated to the measured ~50 ms a step: {after}"


def _static_estimate(self: FakeStepLoop, request: Request, model: ModelInstance) -> ResourceRequest:
    """The old way: the loop prices itself from its static StepCostSpec."""
    steps = request.diffusion.steps or 1
    return ResourceRequest(gpu_seconds=steps * self.spec.step_cost.fixed_seconds * self.spec.step_cost.conservative_factor)


def test_negative_control_a_statically_priced_estimate_ignores_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeStepLoop, "estimate", _static_estimate)
    engine = _slow_fake_engine()
    before = engine.reservation_for(engine.validate(video(9, steps=10))).gpu_seconds
    run_serially(engine, [video(0, steps=3)])
    assert engine.cost_model.samples(next(iter(engine.cost_model._factor))) == 3, "the Profiler did calibrate"
    after = engine.reservation_for(engine.validate(video(9, steps=10))).gpu_seconds
    assert after == before, "a static price cannot see what the Profiler learnt"


def test_a_shape_not_measured_yet_borrows_its_kinds_correction() -> None:
    model = CostModel()
    spec = StepCostSpec(unit="tokens", fixed_seconds=0.0, per_unit_seconds=1e-3, conservative_factor=1.0)
    seen = CostKey("i", "diffusion_step", ShapeSignature.of(tokens=100), "fp32")
    unseen = CostKey("i", "diffusion_step", ShapeSignature.of(tokens=400), "fp32")
    other_kind = CostKey("i", "vae_tile", ShapeSignature.of(tokens=400), "fp32")
    model.observe(seen, spec, measured_seconds=0.3)  # 3x the declared 0.1
    assert model.predict(unseen, spec) == pytest.approx(3 * 0.4)
    assert model.predict(other_kind, spec) == pytest.approx(0.4), "another kind keeps the declared spec"
    step = StepEstimate(loop_id="l", kind=WorkKind.DIFFUSION_STEP, shape_sig=ShapeSignature.of(tokens=400), count=5)
    assert model.price("i", step, spec) == pytest.approx(5 * 3 * 0.4)


# -- block pools --------------------------------------------------------------------------


def test_pool_blocks_are_reserved_against_the_pools_capacity() -> None:
    ctl = AdmissionController(Budgets(memory_bytes="unlimited"))
    ctl.register_pool("inst/kv", 10)
    assert ctl.try_admit(Reservation("a", 0, 0, 0, 0.0, pool_blocks={"inst/kv": 6})) is None
    assert ctl.try_admit(Reservation("b", 0, 0, 0, 0.0, pool_blocks={"inst/kv": 6})) == "pool_blocks"
    assert ctl.pool_blocks_in_use("inst/kv") == 6
    with pytest.raises(CapacityError, match=r"needs 11 blocks of block pool 'inst/kv'; the pool has 10"):
        ctl.try_admit(Reservation("c", 0, 0, 0, 0.0, pool_blocks={"inst/kv": 11}))
    with pytest.raises(ValueError, match="not registered"):
        ctl.try_admit(Reservation("d", 0, 0, 0, 0.0, pool_blocks={"inst/other": 1}))
    ctl.release("a")
    assert ctl.try_admit(Reservation("b", 0, 0, 0, 0.0, pool_blocks={"inst/kv": 6})) is None


def test_memory_is_accounted_per_device_and_bounds_batch_peaks() -> None:
    ctl = AdmissionController(Budgets(memory_bytes=100))
    ctl.set_memory_capacity("cuda:0", 50)
    assert ctl.try_admit(Reservation("a", 30, 10, 0, 0.0, device="cuda:0")) is None
    assert ctl.try_admit(Reservation("b", 30, 10, 0, 0.0, device="cuda:0")) == "memory", "30+30+10 > 50"
    assert ctl.try_admit(Reservation("c", 60, 10, 0, 0.0, device="cpu")) is None, "another device: its own budget"
    assert ctl.memory_in_use("cuda:0") == 40 and ctl.memory_in_use() == 110
    assert ctl.peak_headroom() == 20, "cuda:0 has 50 - 30 resident free for the summed peaks of a batch"


KV = PagedKVConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=6, max_blocks_per_sequence=3)
TOKENS = 12  # three blocks: a pool of six holds two requests


@dataclass
class PooledInstance(ModelInstance):
    pool: PagedKVPool | None = None

    def block_pools(self) -> dict[str, PagedKVPool]:
        assert self.pool is not None
        return {"kv": self.pool}


class PooledLoop(FakeStepLoop):
    """Takes its blocks at init (whole-life, like an AR decode loop) and frees them when it ends."""

    def init(self, request, model, ctx) -> FakeState:  # type: ignore[no-untyped-def]
        self._pool = model.pool  # the instance's pool (per instance, like the weights)
        model.pool.allocate(request.request_id, tokens=TOKENS)
        return super().init(request, model, ctx)

    def finalize(self, state):  # type: ignore[no-untyped-def]
        self._pool.free_owner(state.request_id)
        return super().finalize(state)

    def estimate(self, request, model) -> ResourceRequest:  # type: ignore[no-untyped-def]
        return super().estimate(request, model).model_copy(update={"pool_blocks": {"kv": model.pool.blocks_for(TOKENS)}})


class InFlight(Observer):
    """Samples, after every executed step, how many requests run and how many pool blocks are taken."""

    name = "in-flight"

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        self.engine: Engine | None = None
        self.running: list[int] = []
        self.blocks: list[int] = []

    def on_step(self, record: StepRecord) -> None:
        assert self.engine is not None
        self.running.append(self.engine.running_count())
        self.blocks.append(self.pool.used_blocks)


def _pooled_engine() -> tuple[Engine, InFlight]:
    card = fake_card(step_seconds=0.001)
    plain = build_fake_instance(card, InstanceOptions())
    instance = PooledInstance(card=card, options=plain.options, component_loader=plain.component_loader,
                              ops_builder=plain.ops_builder, weights_version="fake", pool=PagedKVPool(KV))
    instance._loops["run"] = PooledLoop(card.loops["run"])
    watch = InFlight(instance.pool)
    engine = watch.engine = Engine(SchedulerConfig(device_thread=False), observers=[watch])
    engine.add_instance(instance)
    return engine, watch


def test_a_request_whose_blocks_are_taken_waits_and_never_fails() -> None:
    engine, watch = _pooled_engine()
    results = run_concurrently(engine, [video(i, steps=3) for i in range(7)])
    assert [r.status for r in results] == ["completed"] * 7
    assert max(watch.running) == 2 and max(watch.blocks) == 6, "two at a time: exactly what the pool holds"
    assert engine.metrics.rejections.get("admission_pool_blocks", 0) >= 1
    assert engine.admission.pool_blocks_in_use(next(iter(engine.admission.pools))) == 0


def test_negative_control_without_the_pool_reservation_the_allocation_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PooledLoop, "estimate", FakeStepLoop.estimate)  # the blocks left out of the reservation
    engine, _ = _pooled_engine()
    results = run_concurrently(engine, [video(i, steps=3) for i in range(7)])
    failed = [r for r in results if r.status == "failed"]
    assert failed and all(r.error is not None and r.error.type == "capacity" for r in failed)


def test_waiting_requests_start_in_submission_order() -> None:
    engine, _ = _pooled_engine()

    async def go() -> list[str]:
        started: list[str] = []
        async with engine.running():
            handles = [engine.submit(video(i, steps=3)) for i in range(7)]

            async def watch(handle) -> None:  # type: ignore[no-untyped-def]
                async for event in handle.events():
                    if event.type == "request.started":
                        started.append(handle.request_id)

            await asyncio.gather(*(watch(h) for h in handles))
        return started

    assert asyncio.run(go()) == [f"v{i}" for i in range(7)], "first in, first out: nobody overtakes a waiting request"


class PeakyLoop(FakeStepLoop):
    """Every step declares a 30-byte transient peak."""

    def next(self, state):  # type: ignore[no-untyped-def]
        plan = super().next(state)
        return plan if not hasattr(plan, "resources") else plan.model_copy(update={"resources": ResourceRequest(peak_bytes=30)})


def _peaky_engine() -> Engine:
    engine = Engine(SchedulerConfig(device_thread=False, budgets=Budgets(memory_bytes=100)))
    instance = build_instance(fake_card(resident_bytes=20, peak_bytes=30))
    instance._loops["run"] = PeakyLoop(instance.card.loops["run"])
    engine.add_instance(instance)
    return engine


def test_a_batch_adds_up_peaks_only_within_what_residents_leave_free(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _peaky_engine()
    results = run_concurrently(engine, [video(i, steps=3) for i in range(3)])
    assert all(r.status == "completed" for r in results)
    # 3 x 20 resident leaves 40 bytes: one 30-byte peak at a time (two once a request has finished).
    assert max(engine.metrics.batches_by_size) < 3, engine.metrics.batches_by_size
    # Negative control: the same requests with the scheduling loop's headroom ignored batch all three steps.
    monkeypatch.setattr(AdmissionController, "peak_headroom", lambda self: None)
    engine = _peaky_engine()
    run_concurrently(engine, [video(i, steps=3) for i in range(3)])
    assert max(engine.metrics.batches_by_size) == 3


# -- toy estimates describe the steps the loops run -----------------------------------------


@pytest.mark.parametrize(
    ("model", "request_"),
    [
        ("toy-dit", Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="fox"),),
                            diffusion=DiffusionParams(height=8, width=16, frames=3, steps=3, guidance=3.0))),
        ("toy-dit", Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="fox"),),
                            diffusion=DiffusionParams(steps=2, guidance=1.0, sampler="unipc"))),
        ("toy-omni", Request(model="toy-omni", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a cat"),),
                             prompt_upsampling=True, ar=ARParams(max_tokens=5, seed=1))),
    ],
    ids=["toy-dit-cfg", "toy-dit-unipc-nocfg", "toy-omni-upsample"],
)
def test_toy_estimates_price_the_steps_the_loops_run(model: str, request_: Request) -> None:
    engine = Engine(SchedulerConfig(device_thread=False), observers=[StepRecorder()])
    engine.add_instance(build_instance(toy_card(model)))
    # The AR loop may stop at EOS before its max_tokens cap; the diffusion loops run every estimated step.
    assert_estimate_covers_execution(engine, request_, exact=model != "toy-omni")


def test_toy_lm_estimate_covers_every_token_step_at_its_context() -> None:
    engine = Engine(SchedulerConfig(device_thread=False), observers=[StepRecorder()])
    engine.add_instance(build_instance(toy_card("toy-lm")))
    request = Request(model="toy-lm", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="hello"),),
                      ar=ARParams(max_tokens=6, seed=3))
    assert_estimate_covers_execution(engine, request, exact=False)
