"""Weight sync while serving: freeze admission -> drain -> load -> bump weights_version -> clear caches -> resume."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fv_kernel.api import Engine
from fv_rl.online import load_policy_into
from rl_helpers import engine_for, request, tiny_instance


def _perturbed(instance):
    import copy

    module = copy.deepcopy(instance.component("transformer"))
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1.5)
    return module


def _frames(result):
    assert result.status == "completed", result.error
    return result.artifact("video").frames


def _reference(new_weights):
    """What each weight set gives for the two requests, each alone on a fresh engine."""
    old_instance = tiny_instance()
    new_instance = tiny_instance()
    new_instance.component("transformer").load_state_dict(new_weights.state_dict())
    outs = []
    for inst, req in ((old_instance, request(seed=1, steps=6)), (new_instance, request(prompt="a blue lake", seed=2))):
        outs.append(_frames(engine_for(inst).generate(req)))
    return outs


def _serve_and_sync(engine: Engine, model_id: str, new_weights):
    async def go():
        async with engine.running():
            in_flight = engine.submit(request(seed=1, steps=6))
            async for event in in_flight.events():  # two denoise steps into the request
                if event.type == "progress" and event.loop_id == "denoise" and event.step == 2:
                    break
            version_before = engine.instances[model_id].weights_version
            cached_before = len(engine.services["feature_cache"])
            sync = asyncio.ensure_future(engine.sync_weights(model_id, load_policy_into(new_weights)))
            await asyncio.sleep(0)
            during = engine.submit(request(prompt="a blue lake", seed=2))  # arrives while admission is frozen
            version = await sync
            first, second = await in_flight.result(), await during.result()
            return first, second, version_before, version, cached_before

    return asyncio.run(go())


def test_in_flight_request_finishes_on_old_weights_and_the_next_sees_the_new():
    instance = tiny_instance()
    new_weights = _perturbed(instance)
    old_ref, new_ref = _reference(new_weights)
    engine = engine_for(instance)
    first, second, before, after, cached = _serve_and_sync(engine, "wan-tiny", new_weights)
    assert torch.equal(_frames(first), old_ref)
    assert torch.equal(_frames(second), new_ref)
    assert after != before and after.endswith("+sync1")
    assert first.artifact("video").provenance.weights_version == before
    assert second.artifact("video").provenance.weights_version == after
    assert cached >= 1 and engine.services["feature_cache"].stats.misses >= 2  # the new version re-encoded the prompt


def test_negative_control_without_the_drain_the_in_flight_request_mixes_policies(monkeypatch):
    instance = tiny_instance()
    new_weights = _perturbed(instance)
    old_ref, _ = _reference(new_weights)
    engine = engine_for(instance)

    async def no_drain(instance):
        return None

    monkeypatch.setattr(engine, "_drain", no_drain)
    first, *_ = _serve_and_sync(engine, "wan-tiny", new_weights)
    assert not torch.equal(_frames(first), old_ref)


def test_sync_needs_a_running_engine_and_a_known_model():
    engine = engine_for(tiny_instance())
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(engine.sync_weights("wan-tiny", lambda inst: None))

    async def go():
        async with engine.running():
            await engine.sync_weights("nope", lambda inst: None)

    with pytest.raises(Exception, match="nope"):
        asyncio.run(go())
