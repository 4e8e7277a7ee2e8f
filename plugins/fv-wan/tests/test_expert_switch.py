"""A request's ``switch_step`` on a two-expert card: which expert runs each step, what the
sampler is told (``stage_starts``), and the typed errors for a value the card cannot take."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_kernel.api import DiffusionParams, InvalidRequest, Request, TaskType, TextPart, build_instance, resolve_request
from fv_kernel.runtime.local import run_local
from fv_wan.cards import wan_cards

CARDS = {card.model_id: card for card in wan_cards()}
STEPS = 4


def _request(card_id: str, **diffusion: Any) -> Request:
    return Request(model=card_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),),
                   diffusion=DiffusionParams(seed=1, width=32, height=32, frames=5, steps=STEPS, **diffusion))


@pytest.fixture(scope="module")
def a14b() -> Any:
    instance = build_instance(CARDS["wan-tiny-a14b"])
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)  # the experts' modules, to hook
    return instance


def _experts_per_step(instance: Any, request: Request) -> tuple[list[str], torch.Tensor]:
    """The expert each model call ran, one entry per step (CFG's two calls of a step agree), and the video."""
    calls: list[str] = []
    hooks = [instance.components[name].register_forward_pre_hook(lambda *_, name=name: calls.append(name))
             for name in ("transformer", "transformer_2")]
    try:
        (video,) = run_local(request, instance)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(calls) == 2 * STEPS and calls[0::2] == calls[1::2], calls
    return calls[0::2], video.frames


@pytest.mark.parametrize("switch_step", [0, 1, 3, STEPS])
def test_switch_step_picks_the_expert_of_every_step(a14b: Any, switch_step: int) -> None:
    experts, _ = _experts_per_step(a14b, _request("wan-tiny-a14b", switch_step=switch_step))
    assert experts == ["transformer"] * switch_step + ["transformer_2"] * (STEPS - switch_step)


def test_without_it_the_cards_boundary_decides_and_the_video_differs(a14b: Any) -> None:
    default, video = _experts_per_step(a14b, _request("wan-tiny-a14b"))
    # Negative control for the test above: the card's own boundary puts the switch elsewhere.
    assert default == ["transformer"] * 3 + ["transformer_2"] * (STEPS - 3)
    _, moved = _experts_per_step(a14b, _request("wan-tiny-a14b", switch_step=1))
    assert not torch.equal(video, moved)
    _, same = _experts_per_step(a14b, _request("wan-tiny-a14b", switch_step=3))
    assert torch.equal(video, same)  # the boundary's own step: the same run, bit for bit


def test_the_denoise_state_carries_the_switch_and_tells_the_sampler(a14b: Any) -> None:
    from fv_kernel.api import LoopContext
    from fv_wan.loops import WanDenoiseLoop, WanDenoiseState

    card = a14b.card
    loop = WanDenoiseLoop(card.loops["denoise"])
    request = resolve_request(card, _request("wan-tiny-a14b", switch_step=2))
    embeds = torch.zeros(1, 8, card.components["transformer"].config["text_dim"])
    ctx = LoopContext(request=request, executor=None, upstream={"prompt_embeds": embeds, "negative_embeds": embeds})  # type: ignore[arg-type]
    state = loop.init(request, a14b, ctx)
    assert state.switch_step == 2 and state.sampler_state.stage_starts == (2,)
    restored = WanDenoiseState.from_bytes(state.to_bytes())  # serializable, so a resumed run keeps it
    assert restored.switch_step == 2 and restored.sampler_state.stage_starts == (2,)
    # Without switch_step the boundary's step is named (3 here: see the test above).
    plain = resolve_request(card, _request("wan-tiny-a14b"))
    default = loop.init(plain, a14b, LoopContext(request=plain, executor=None, upstream=ctx.upstream))  # type: ignore[arg-type]
    assert default.switch_step is None and default.sampler_state.stage_starts == (3,)


def test_a_switch_step_past_the_last_step_is_refused_naming_the_range() -> None:
    with pytest.raises(InvalidRequest) as caught:
        resolve_request(CARDS["wan-tiny-a14b"], _request("wan-tiny-a14b", switch_step=STEPS + 1))
    assert caught.value.param == "switch_step" and f"0..{STEPS}" in str(caught.value)


def test_a_single_expert_card_refuses_it() -> None:
    with pytest.raises(InvalidRequest) as caught:
        resolve_request(CARDS["wan-tiny"], _request("wan-tiny", switch_step=1))
    assert caught.value.param == "switch_step" and "single expert" in str(caught.value)


def test_a_negative_switch_step_is_refused_by_the_request() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="switch_step"):
        DiffusionParams(switch_step=-1)


def test_facade_takes_switch_step_and_names_it_in_errors() -> None:
    from fv_kernel.api import load

    generator = load("wan-tiny-a14b")
    with pytest.raises(InvalidRequest) as caught:
        generator.generate("a fox", steps=STEPS, switch_step=STEPS + 2, width=32, height=32, frames=5)
    assert caught.value.param == "switch_step"


def test_the_cli_example_in_docs_models_wan_md_runs_as_written(tmp_path: Any) -> None:
    from doc_blocks import REPO, doc_blocks, run_doc_block

    (block,) = doc_blocks(REPO / "docs" / "models" / "wan.md", "plugins/fv-wan/tests/test_expert_switch.py")
    output = run_doc_block(block, tmp_path)
    assert (tmp_path / "fox.mp4").stat().st_size > 0, output
