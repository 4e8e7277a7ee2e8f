"""StepSkip (a step interceptor), and card refusals: a DMD few-step card refuses step skipping
with a typed error but accepts block caching."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cachedit_testutils import StateCapture, any_card, t2v

from fv_cachedit import DBCache, StepSkip, block_cache_stats
from fv_kernel.model.instance import build_instance
from fv_kernel.errors import InvalidRequest
from fv_kernel.extend.registry import ExtensionConfigError, ExtensionSet, InterceptorRejected
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.runtime.local import run_local
from fv_kernel.testing.card_kit import assert_artifacts_identical, roundtrip_state


def step_skip(**config: Any) -> ExtensionSet:
    return ExtensionSet.build({"step-skip": {"config": config}}, {"step-skip": StepSkip})


def engine(extensions: ExtensionSet, model: str) -> Engine:
    e = Engine(SchedulerConfig(device_thread=False), extensions=extensions)
    e.add_instance(build_instance(any_card(model)))
    return e


@pytest.mark.parametrize("model", ["toy-dit", "wan-tiny"])
def test_skipped_steps_reuse_the_last_prediction(instance: Any, model: str) -> None:
    inst = instance(model)
    capture = StateCapture()
    params = {"step-skip": {"warmup_steps": 2, "compute_every": 3}}
    skipped = run_local(t2v(model, steps=10, params=params), inst, extensions=step_skip(), on_state=capture)
    state = capture.plugin("step-skip")
    assert state["computed_steps"] == [0, 1, 2, 5, 8] and state["skipped_steps"] == [3, 4, 6, 7, 9]
    plain = run_local(t2v(model, steps=10), inst)
    assert not torch.equal(plain[0].frames, skipped[0].frames)
    resumed = run_local(t2v(model, steps=10, params=params), inst, extensions=step_skip(), on_state=roundtrip_state)
    assert_artifacts_identical(skipped, resumed, what="step-skip save/resume")


def test_mask_schedule_and_exactness(instance: Any) -> None:
    inst = instance("toy-dit")
    capture = StateCapture()
    mask = [1, 1, 0, 1, 0, 0]
    run_local(t2v("toy-dit", steps=8, params={"step-skip": {"steps_computation_mask": mask}}), inst,
              extensions=step_skip(), on_state=capture)
    assert capture.plugin("step-skip")["skipped_steps"] == [2, 4, 5], "steps past the mask's end compute"
    plain = run_local(t2v("toy-dit", steps=8), inst)
    never = run_local(t2v("toy-dit", steps=8, params={"step-skip": {"compute_every": 1}}), inst, extensions=step_skip())
    assert_artifacts_identical(plain, never, what="compute_every=1 skips nothing")


def test_step_skip_params_are_validated_and_exact_mode_refuses_skipping() -> None:
    e = engine(step_skip(), "toy-dit")
    with pytest.raises(InvalidRequest, match=r"plugin_params\.step-skip\.steps_computation_mask"):
        e.validate(t2v("toy-dit", params={"step-skip": {"steps_computation_mask": [0, 1]}}))
    with pytest.raises(InvalidRequest, match=r"plugin_params\.step-skip\.steps_computation_mask"):
        e.validate(t2v("toy-dit", params={"step-skip": {"steps_computation_mask": [1, 2]}}))
    with pytest.raises(InvalidRequest, match=r"plugin_params\.step-skip\.compute_every"):
        e.validate(t2v("toy-dit", params={"step-skip": {"compute_every": 0}}))
    with pytest.raises(InvalidRequest, match=r"plugin_params\.step-skip"):
        e.validate(t2v("toy-dit", params={"step-skip": {"skip": True}}))
    with pytest.raises(InvalidRequest, match="exact-mode"):
        e.validate(t2v("toy-dit", params={"step-skip": {"compute_every": 2}}, exact=True))
    e.validate(t2v("toy-dit", params={"step-skip": {"compute_every": 1}}, exact=True))


def test_a_dmd_card_refuses_step_skipping_with_a_typed_error() -> None:
    e = engine(step_skip(compute_every=2), "fastwan-tiny")
    with pytest.raises(InterceptorRejected) as info:
        e.validate(t2v("fastwan-tiny", steps=3, params={"step-skip": {}}))
    assert info.value.param == "plugin_params.step-skip"
    assert "dmd2" in str(info.value) and "refuses step_skip" in str(info.value)
    with pytest.raises(ExtensionConfigError, match="fastwan-tiny"):
        engine(ExtensionSet.build({"step-skip": {"default_on": True}}, {"step-skip": StepSkip}), "fastwan-tiny")
    # The base card of the same family accepts it.
    engine(step_skip(compute_every=2), "wan-tiny").validate(t2v("wan-tiny", params={"step-skip": {}}))


def test_a_dmd_card_accepts_block_caching(instance: Any) -> None:
    """The issue's refusal is for step skipping only; cache-dit also caches blocks on distilled models."""
    extensions = ExtensionSet.build({"dbcache": {"config": {"fn_compute_blocks": 1, "max_warmup_steps": 1}}},
                                    {"dbcache": DBCache})
    engine(extensions, "fastwan-tiny").validate(t2v("fastwan-tiny", steps=3, params={"dbcache": {}}))
    capture = StateCapture()
    request = t2v("fastwan-tiny", steps=3, params={"dbcache": {"residual_diff_threshold": 0.9}})
    run_local(request, instance("fastwan-tiny"), extensions=extensions, on_state=capture)
    [stats] = block_cache_stats(capture.plugin("dbcache")).values()
    assert stats.steps == 3 and stats.computed_steps[0] == 0
