"""The decode loop's ``halo`` config: exact halo tiles through the Engine (``WanDecodeLoop``).

- A request decoded in halo tiles gives the video of the frame-by-frame decode (fp32, within rounding),
  in 1 + tiles steps, with the whole-frame step first.
- Its admission estimate is below the frame-by-frame decode's peak for the same request.
- The config is validated by name: ``halo`` with ``tiling``, a bad grid, a grid finer than the latents.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from fv_kernel.api import (
    DiffusionParams,
    Engine,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    build_instance,
    resolve_request,
    run_serially,
)
from fv_kernel.testing import StepRecorder, assert_estimate_covers_execution
from fv_wan.cards import wan_cards
from fv_wan.models.vae import WanVAEConfig, halo_reach
from tiny_vae_configs import CFG21, CFG22


def _card(**decode_config: Any) -> Any:
    card = next(c for c in wan_cards() if c.model_id == "wan-tiny")
    if not decode_config:
        return card
    loops = {
        k: (v.model_copy(update={"config": {**v.config, **decode_config}}) if v.kind == "vae_decode" else v)
        for k, v in card.loops.items()
    }
    return card.model_copy(update={"loops": loops})


def _request(width: int = 64) -> Request:
    return Request(
        request_id="halo", model="wan-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox in the snow"),),
        diffusion=DiffusionParams(seed=3, steps=2, height=32, width=width, frames=9, guidance=1.0),
    )


def _run(card: Any, request: Request) -> tuple[torch.Tensor, list[str]]:
    recorder = StepRecorder()
    engine = Engine(SchedulerConfig(), observers=[recorder])  # type: ignore[arg-type]
    engine.add_instance(build_instance(card))
    result = run_serially(engine, [request])[0]
    result.raise_for_status()
    ops = [record.op for record in recorder.records if record.op.startswith("vae_")]
    video = result.artifact("video")
    assert video is not None
    return video.frames, ops


def test_halo_tiles_through_the_engine_decode_the_same_video() -> None:
    request = _request()
    plain, plain_ops = _run(_card(), request)
    tiled, ops = _run(_card(halo={"rows": 1, "columns": 2}), request)
    assert plain_ops == ["vae_decode_frame"] * 3
    assert ops == ["vae_decode_lower", "vae_decode_halo_tile", "vae_decode_halo_tile"]
    assert tiled.shape == plain.shape
    assert (tiled - plain).abs().max().item() < 1e-5


def _decode_estimate(card: Any, request: Request) -> Any:
    instance = build_instance(card)
    decode_id = next(k for k, v in card.loops.items() if v.kind == "vae_decode")
    return instance.loop(decode_id).estimate(resolve_request(card, request), instance)


def test_halo_estimate_reserves_less_than_the_frame_by_frame_decode() -> None:
    request = _request(width=512)
    plain = _decode_estimate(_card(), request)
    tiled = _decode_estimate(_card(halo={"rows": 1, "columns": 4}), request)
    assert [s.count for s in tiled.steps] == [1, 4]
    assert tiled.peak_bytes < plain.peak_bytes


def test_halo_estimate_prices_the_steps_the_loop_runs() -> None:
    engine = Engine(SchedulerConfig(device_thread=False), observers=[StepRecorder()])
    engine.add_instance(build_instance(_card(halo={"rows": 2, "columns": 2})))
    assert_estimate_covers_execution(engine, _request())


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"halo": {"rows": 1, "columns": 2}, "tiling": {"tile_sample_min_height": 64}}, "'tiling' .* and 'halo' .* exclude each other"),
        ({"halo": {"rows": 0}}, "config 'halo' is invalid.*rows"),
        ({"halo": {"columns": 2, "overlap": 4}}, "config 'halo' is invalid.*overlap"),
        ({"halo": 2}, "config 'halo' must be a mapping"),
        ({"halo": {"columns": 99}}, "needs at least one latent pixel per tile; the latents are 4 x 8"),
    ],
)
def test_bad_halo_configs_are_refused_by_name(config: dict[str, Any], message: str) -> None:
    engine = Engine(SchedulerConfig())
    engine.add_instance(build_instance(_card(**config)))
    result = run_serially(engine, [_request()])[0]
    assert result.status == "failed" and result.error is not None  # the request fails; the engine lives on
    assert re.search(message, result.error.message), result.error.message


@pytest.mark.parametrize("config", [CFG21, CFG22, WanVAEConfig.wan21(), WanVAEConfig.wan22()], ids=["tiny2.1", "tiny2.2", "2.1", "2.2"])
def test_the_configs_reach_is_the_modules(config: WanVAEConfig) -> None:
    """The estimate's reach (from the config) and the decode's (from the built decoder) agree."""
    from fv_wan.models.vae import WanVAE

    with torch.device("meta"):
        decoder = WanVAE(config).decoder
    assert halo_reach(config) == decoder.halo_geometry()[1][0]


def test_a_halo_decode_state_survives_serialization() -> None:
    """Mid-way (the whole-frame part done, one strip decoded) the state reads back as it was."""
    from fv_wan.loops import WanDecodeState
    from fv_wan.models.vae import HaloTiling

    g = torch.Generator().manual_seed(0)
    state = WanDecodeState(
        request_id="r", loop_id="decode", instance_id="i", model_id="wan-tiny", weights_version="v", seed=1,
        latents=torch.randn(1, 4, 3, 4, 8, generator=g), fps=16.0, halo=HaloTiling(columns=2, align=8),
        lower=torch.randn(1, 8, 3, 4, 8, generator=g), strips=[torch.rand(3, 9, 32, 32, generator=g)], step=2,
    )
    back = WanDecodeState.from_bytes(state.to_bytes())
    assert back.halo == HaloTiling(columns=2, align=8) and back.step == 2
    assert torch.equal(back.lower, state.lower) and torch.equal(back.strips[0], state.strips[0])
