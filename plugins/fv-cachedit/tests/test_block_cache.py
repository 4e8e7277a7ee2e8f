"""DBCache / FBCache / TaylorSeer through fv loops on toy-dit (kernel) and wan-tiny (fv-wan):
exactness at threshold 0, per-branch state, save/resume, validation, exact mode, conflicts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cachedit_testutils import StateCapture, t2v

from fv_cachedit import DBCache, FBCache, TaylorSeer, block_cache_stats
from fv_kernel.errors import InvalidRequest
from fv_kernel.extend.registry import ExtensionConfigError, ExtensionSet
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.runtime.local import run_local
from fv_kernel.testing.card_kit import assert_artifacts_identical, roundtrip_state

CACHES = {"dbcache": DBCache, "fbcache": FBCache, "taylorseer": TaylorSeer}
# The tiny cards have 2 blocks: block 0 is Fn, block 1 the cached middle.
TINY = {"fn_compute_blocks": 1, "bn_compute_blocks": 0, "max_warmup_steps": 2}


def extensions(plugin_id: str, **config: Any) -> ExtensionSet:
    return ExtensionSet.build({plugin_id: {"config": config}}, {plugin_id: CACHES[plugin_id]})


def tiny_config(plugin_id: str) -> dict[str, Any]:
    return {k: v for k, v in TINY.items() if not (plugin_id == "fbcache" and k == "fn_compute_blocks")}


@pytest.mark.parametrize("model", ["toy-dit", "wan-tiny"])
@pytest.mark.parametrize("plugin_id", sorted(CACHES))
def test_threshold_zero_is_bit_identical_to_no_interceptor(instance: Any, model: str, plugin_id: str) -> None:
    inst = instance(model)
    plain = run_local(t2v(model, steps=6), inst)
    exact = run_local(t2v(model, steps=6, params={plugin_id: {"residual_diff_threshold": 0.0}}), inst,
                      extensions=extensions(plugin_id, **tiny_config(plugin_id)))
    assert_artifacts_identical(plain, exact, what=f"{plugin_id} threshold 0 on {model}")


@pytest.mark.parametrize("model", ["toy-dit", "wan-tiny"])
def test_caching_reuses_steps_per_branch_and_changes_the_output(instance: Any, model: str) -> None:
    inst = instance(model)
    capture = StateCapture()
    request = t2v(model, params={"dbcache": {"residual_diff_threshold": 0.3}})
    cached = run_local(request, inst, extensions=extensions("dbcache", **TINY), on_state=capture)
    stats = block_cache_stats(capture.plugin("dbcache"))
    assert set(stats) == {"cond", "uncond"}, "CFG branches keep separate state"
    for branch, s in stats.items():
        assert s.computed_steps[:2] == (0, 1), f"{branch}: warmup steps compute"
        assert s.steps == 12 and s.cached_steps, f"{branch}: {s}"
        assert all(step in s.residual_diffs for step in s.cached_steps)
    plain = run_local(t2v(model), inst)
    assert not torch.equal(plain[0].frames, cached[0].frames)


def test_branch_states_are_separate_objects_with_their_own_residuals(instance: Any) -> None:
    capture = StateCapture()
    run_local(t2v("toy-dit", params={"dbcache": {"residual_diff_threshold": 0.3}}), instance("toy-dit"),
              extensions=extensions("dbcache", **TINY), on_state=capture)
    state = capture.plugin("dbcache")
    cond, uncond = state["cond"], state["uncond"]
    assert cond is not uncond
    assert not torch.equal(cond["fn_residual"], uncond["fn_residual"])
    assert cond["residual_diffs"] != uncond["residual_diffs"]


@pytest.mark.parametrize("model", ["toy-dit", "wan-tiny"])
@pytest.mark.parametrize("plugin_id", ["dbcache", "taylorseer"])
def test_state_round_trips_with_the_loop_state(instance: Any, model: str, plugin_id: str) -> None:
    inst = instance(model)
    ext = extensions(plugin_id, **TINY)
    params = {plugin_id: {"residual_diff_threshold": 0.3}}
    if plugin_id == "taylorseer":
        params[plugin_id]["taylorseer_order"] = 2
    straight = run_local(t2v(model, params=params), inst, extensions=ext)
    resumed = run_local(t2v(model, params=params), inst, extensions=ext, on_state=roundtrip_state)
    assert_artifacts_identical(straight, resumed, what=f"{plugin_id} save/resume on {model}")


def test_taylorseer_extrapolates_instead_of_reusing(instance: Any) -> None:
    inst = instance("toy-dit")
    outputs = {}
    for plugin_id, extra in (("dbcache", {}), ("taylorseer", {"taylorseer_order": 1}), ("taylorseer", {"taylorseer_order": 2})):
        capture = StateCapture()
        params = {plugin_id: {"residual_diff_threshold": 0.3, "max_warmup_steps": 4, **extra}}
        outputs[(plugin_id, extra.get("taylorseer_order"))] = run_local(
            t2v("toy-dit", params=params), inst, extensions=extensions(plugin_id, **TINY), on_state=capture
        )[0].frames
        state = capture.plugin(plugin_id)["cond"]
        if plugin_id == "taylorseer":
            assert len(state["taylor_ladder"]) == 1 + extra["taylorseer_order"]
    assert not torch.equal(outputs[("dbcache", None)], outputs[("taylorseer", 1)])
    assert not torch.equal(outputs[("taylorseer", 1)], outputs[("taylorseer", 2)])


def test_caps_limit_reuse(instance: Any) -> None:
    inst = instance("toy-dit")
    capture = StateCapture()
    params = {"dbcache": {"residual_diff_threshold": 0.9, "max_cached_steps": 5, "max_continuous_cached_steps": 2}}
    run_local(t2v("toy-dit", steps=16, params=params), inst, extensions=extensions("dbcache", **TINY), on_state=capture)
    for branch, s in block_cache_stats(capture.plugin("dbcache")).items():
        assert len(s.cached_steps) == 5, branch
        runs = [1]
        for a, b in zip(s.cached_steps, s.cached_steps[1:]):
            runs[-1:] = [runs[-1] + 1] if b == a + 1 else [runs[-1], 1]
        assert max(runs) == 2, (branch, s.cached_steps)
    capture = StateCapture()
    params = {"dbcache": {"residual_diff_threshold": 0.9, "max_warmup_steps": 6, "warmup_interval": 2}}
    run_local(t2v("toy-dit", steps=8, params=params), inst, extensions=extensions("dbcache", **TINY), on_state=capture)
    cond = block_cache_stats(capture.plugin("dbcache"))["cond"]
    assert {0, 2, 4} <= set(cond.computed_steps) and {1, 3, 5} <= set(cond.cached_steps), cond


def _engine(ext: ExtensionSet, model: str = "toy-dit") -> Engine:
    from cachedit_testutils import any_card

    from fv_kernel.model.instance import build_instance

    e = Engine(SchedulerConfig(device_thread=False), extensions=ext)
    e.add_instance(build_instance(any_card(model)))
    return e


def test_request_params_are_validated_by_field() -> None:
    e = _engine(extensions("dbcache", **TINY))
    with pytest.raises(InvalidRequest, match="plugin_params.dbcache") as info:
        e.validate(t2v("toy-dit", params={"dbcache": {"threshold": 0.1}}))
    assert "threshold" in str(info.value)
    with pytest.raises(InvalidRequest, match=r"plugin_params\.dbcache\.residual_diff_threshold"):
        e.validate(t2v("toy-dit", params={"dbcache": {"residual_diff_threshold": -0.1}}))
    with pytest.raises(InvalidRequest, match=r"plugin_params\.dbcache\.max_cached_steps"):
        e.validate(t2v("toy-dit", params={"dbcache": {"max_cached_steps": -2}}))
    fb = _engine(extensions("fbcache"))
    with pytest.raises(InvalidRequest, match=r"plugin_params\.fbcache\.fn_compute_blocks"):
        fb.validate(t2v("toy-dit", params={"fbcache": {"fn_compute_blocks": 2}}))
    ts = _engine(extensions("taylorseer", **TINY))
    with pytest.raises(InvalidRequest, match=r"plugin_params\.taylorseer\.taylorseer_order"):
        ts.validate(t2v("toy-dit", params={"taylorseer": {"taylorseer_order": 3}}))


def test_exact_mode_rejects_a_positive_threshold() -> None:
    e = _engine(extensions("dbcache", **TINY))
    with pytest.raises(InvalidRequest, match="exact-mode"):
        e.validate(t2v("toy-dit", params={"dbcache": {}}, exact=True))  # the deploy default 0.08 alters
    e.validate(t2v("toy-dit", params={"dbcache": {"residual_diff_threshold": 0.0}}, exact=True))
    exact_deploy = _engine(extensions("dbcache", residual_diff_threshold=0.0))
    exact_deploy.validate(t2v("toy-dit", params={"dbcache": {}}, exact=True))


def test_deploy_config_is_validated_and_conflicts_are_rejected() -> None:
    with pytest.raises(ExtensionConfigError, match=r"extensions\.dbcache\.config\.bn_compute_blocks"):
        ExtensionSet.build({"dbcache": {"config": {"bn_compute_blocks": -1}}}, {"dbcache": DBCache})
    with pytest.raises(ExtensionConfigError, match=r"extensions\.dbcache\.config\.fn_blocks"):
        ExtensionSet.build({"dbcache": {"config": {"fn_blocks": 1}}}, {"dbcache": DBCache})
    with pytest.raises(ExtensionConfigError, match="conflicts with"):
        ExtensionSet.build({"dbcache": {}, "taylorseer": {}}, dict(CACHES))
    with pytest.raises(ExtensionConfigError, match="conflicts with"):
        ExtensionSet.build({"fbcache": {}, "dbcache": {}}, dict(CACHES))


def test_default_on_applies_deploy_defaults_without_request_params(instance: Any) -> None:
    ext = ExtensionSet.build({"dbcache": {"default_on": True, "config": {**TINY, "residual_diff_threshold": 0.3}}},
                             {"dbcache": DBCache})
    capture = StateCapture()
    run_local(t2v("toy-dit"), instance("toy-dit"), extensions=ext, on_state=capture)
    assert block_cache_stats(capture.plugin("dbcache"))["cond"].cached_steps


def test_too_many_fixed_blocks_fail_the_request_with_a_named_field(instance: Any) -> None:
    with pytest.raises(InvalidRequest, match=r"plugin_params\.dbcache\.fn_compute_blocks.*2-block"):
        run_local(t2v("toy-dit", params={"dbcache": {"fn_compute_blocks": 2}}), instance("toy-dit"),
                  extensions=extensions("dbcache", **TINY))
