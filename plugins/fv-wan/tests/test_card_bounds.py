"""Every Wan card declares what it can compute, and resolve_request refuses the rest before any compute.

The token-grid rule is read from the card's transformer config (its RoPE table); these tests
check it against the transformer's own RoPE module, so a card whose rule drifted from its
model fails here rather than at step 1 of a request.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from fv_kernel.api import InvalidRequest, ModelCard, resolve_request
from fv_wan.cards import wan_cards
from fv_wan.models.transformer import WanRotaryEmbedding, WanTransformerConfig

CARDS = {card.model_id: card for card in wan_cards()}


def _rope(card: ModelCard) -> WanRotaryEmbedding:
    config = WanTransformerConfig(**card.components["transformer"].config)
    rope = WanRotaryEmbedding(config.attention_head_dim, config.rope_max_seq_len)
    rope.build_tables("cpu")
    return rope


@pytest.mark.parametrize("model_id", sorted(CARDS))
def test_the_token_grid_rule_matches_the_transformer_rope(model_id: str) -> None:
    card = CARDS[model_id]
    rule = card.capabilities.token_grid
    assert rule is not None, f"{model_id} declares no token grid"
    rope = _rope(card)
    side, frames, one = rule.max_side, rule.max_frames, rule.pixels_per_token
    # One axis at a time (a full real-size grid would not fit in memory): the largest extent
    # the rule allows positions fine, one token more exceeds the table.
    for allowed, too_big in (
        ((frames, one, one), (frames + rule.frames_per_latent, one, one)),
        ((1, side, one), (1, side + one, one)),
        ((1, one, side), (1, one, side + one)),
    ):
        assert max(rule.grid(*allowed)) == rule.max_per_axis
        rope(rule.grid(*allowed))
        with pytest.raises(ValueError, match="exceeds rope_max_seq_len"):
            rope(rule.grid(*too_big))


def test_wan_tiny_refuses_a_size_beyond_its_rope_table_at_resolve_time(
    wan_card: Callable[..., Any], fv_request: Callable[..., Any]
) -> None:
    card = wan_card("wan-tiny")
    with pytest.raises(InvalidRequest) as info:
        resolve_request(card, fv_request(card, "a fox", height=528, width=512))
    assert info.value.param == "height" and "allowed: height <= 512" in info.value.message
    assert resolve_request(card, fv_request(card, "a fox", height=512, width=512)).diffusion.height == 512
    # Negative control: without the rule the request resolves, and the model fails at its first step.
    unbounded = card.model_copy(update={"capabilities": card.capabilities.model_copy(update={"token_grid": None})})
    resolved = resolve_request(unbounded, fv_request(unbounded, "a fox", height=528, width=512))
    rule = card.capabilities.token_grid
    with pytest.raises(ValueError, match="exceeds rope_max_seq_len"):
        _rope(card)(rule.grid(resolved.diffusion.frames, 528, 512))


@pytest.mark.parametrize("model_id", sorted(CARDS))
def test_every_wan_card_bounds_steps_and_fps(
    model_id: str, wan_card: Callable[..., Any], fv_request: Callable[..., Any]
) -> None:
    card = wan_card(model_id)
    caps = card.capabilities
    assert caps.max_steps == 1000 and (caps.min_fps, caps.max_fps) == (1.0, 120.0)
    image = None
    if "image_encoder" in card.components or "text_to_video" not in {t.value for t in caps.tasks}:
        import torch

        image = torch.zeros(3, caps.defaults.height, caps.defaults.width)
    # A recipe that fixes its step count (DMD2) refuses any other count first, naming the recipe.
    fixed = card.recipe.assumes_loop is not None
    steps_error = r"steps: card .* assumes" if fixed else r"steps: 100000 exceeds the maximum of card .*allowed: 1\.\.1000"
    with pytest.raises(InvalidRequest, match=steps_error):
        resolve_request(card, fv_request(card, "a fox", image=image, steps=100000))
    with pytest.raises(InvalidRequest, match=r"fps: 0\.0001 is outside .*allowed: 1\.\.120"):
        resolve_request(card, fv_request(card, "a fox", image=image, fps=0.0001))
