"""Rollouts run at the geometry the training config names, even outside the card's trained
envelope (fine-tuning there is the point), and each departure is logged once on ``fv.rl``."""

from __future__ import annotations

import asyncio
import logging

import pytest

from fv_kernel.api import CardCatalog, Engine, InvalidRequest, PluginHost, build_instance, resolve_request
from fv_rl import rollout as rollout_module
from fv_rl.rollout import RolloutSettings, rollout_groups

SETTINGS = RolloutSettings(steps=1, height=32, width=32, frames=5)


def run(settings: RolloutSettings, prompts: list[str]) -> list:
    card = CardCatalog(PluginHost()).get("wan-toy")

    async def go() -> list:
        engine = Engine()
        engine.add_instance(build_instance(card))
        async with engine.running():
            return await rollout_groups(engine, "wan-toy", prompts, [[0]] * len(prompts), settings)

    return asyncio.run(go())


def test_rollouts_outside_the_envelope_run_and_say_so_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fv.rl"):
        groups = run(SETTINGS, ["a red circle moves left", "a blue square moves right"])
    assert [len(g) for g in groups] == [1, 1] and groups[0][0].video.shape[0] == 5
    messages = [r.getMessage() for r in caplog.records if r.name == "fv.rl"]
    frames = [m for m in messages if "frames: 5 frames" in m]
    assert len(frames) == 1, messages  # one line for both prompts
    assert any("size:" in m for m in messages), messages


def test_negative_control_without_the_override_the_rollout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = rollout_module._request

    def no_override(*args, **kwargs):
        return plain(*args, **kwargs).model_copy(update={"allow_outside_envelope": False})

    monkeypatch.setattr(rollout_module, "_request", no_override)
    with pytest.raises(InvalidRequest, match="frames"):
        run(SETTINGS, ["a red circle moves left"])
    card = CardCatalog(PluginHost()).get("wan-toy")
    resolve_request(card, plain("wan-toy", "a red circle moves left", 0, SETTINGS))  # the override passes
