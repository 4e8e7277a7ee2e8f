"""The causal Wan cards as a user meets them: registered, described, loadable, refusing other recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from fv_kernel.api import InvalidCard, RecipeMismatch
from fv_kernel import facade
from fv_wan import plugin
from fv_wan.cards import SELF_FORCING_1_3B_SOURCE, causal_wan_cards
from fv_wan.causal import CausalRecipe, check_scheduler_config
from fv_wan.toy_card import TOY_CAUSAL_PROVENANCE, wan_toy_causal_card

CAUSAL_IDS = ("wan2.1-t2v-1.3b-causal", "wan-toy-causal")


def _registered() -> dict[str, object]:
    cards: dict[str, object] = {}
    plugin.fv_register_model_cards(lambda name, card: cards.__setitem__(name, card))
    return cards


def test_both_causal_cards_are_registered_and_in_the_manifest() -> None:
    cards = _registered()
    manifest = yaml.safe_load((Path(plugin.__file__).parent / "fv-plugin.yaml").read_text())
    listed = {entry["name"] for entry in manifest["contributions"]["model_cards"]}
    for model_id in CAUSAL_IDS:
        assert model_id in cards and model_id in listed
        card = cards[model_id]
        assert card.recipe.assumes_loop == "realtime"  # type: ignore[attr-defined]
        assert card.loops["realtime"].kind == "chunk_rollout"  # type: ignore[attr-defined]
        assert card.caches["chunk_kv"].cache_class == "slab_kv"  # type: ignore[attr-defined]


def test_the_1_3b_causal_card_is_self_forcing_s_recipe_on_its_checkpoint() -> None:
    (card,) = causal_wan_cards()
    assert card.checkpoint.source == SELF_FORCING_1_3B_SOURCE == "wlsaidhi/SFWan2.1-T2V-1.3B-Diffusers"
    assert card.checkpoint.layout == "diffusers" and card.components["transformer"].config["num_layers"] == 30
    recipe = CausalRecipe(**card.loops["realtime"].config)
    assert recipe.timesteps == pytest.approx([1000.0, 937.5, 833.33333, 625.0], abs=1e-4)
    assert (recipe.frames_per_chunk, recipe.sink_chunks, recipe.local_chunks, recipe.context_noise) == (3, 0, 7, 0.0)
    # one slab: 3 latent frames x 1560 tokens, 30 layers, K and V, 1536 wide, bf16; 4 sessions' windows
    assert card.caches["chunk_kv"].block_bytes == 2 * 30 * 3 * 1560 * 1536 * 2
    assert card.caches["chunk_kv"].budget_bytes == 4 * 7 * card.caches["chunk_kv"].block_bytes
    assert plugin.fv_resolve_model_source(SELF_FORCING_1_3B_SOURCE) == "wan2.1-t2v-1.3b-causal"


def test_wan_toy_causal_says_where_its_weights_come_from() -> None:
    """The shipped distilled weights (fv-rl self_forcing's export): their recipe and provenance, not wan-toy's."""
    card = wan_toy_causal_card()
    assert card is not None
    assert card.recipe.method == "self_forcing" and card.recipe.assumes_loop == "realtime"
    assert "Self-Forcing (DMD) from teacher 'wan-toy'" in card.recipe.data_contract
    assert TOY_CAUSAL_PROVENANCE not in card.summary and "not distilled" not in card.summary
    assert card.recipe.parents == ("wan-toy",)


def test_a_scheduler_config_at_another_shift_is_refused(tmp_path: Path) -> None:
    (card,) = causal_wan_cards()
    (tmp_path / "scheduler").mkdir()
    config = {"_class_name": "SelfForcingFlowMatchScheduler", "shift": 5.0, "sigma_min": 0.0, "extra_one_step": True,
              "training": True, "num_inference_steps": 1000}
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    check_scheduler_config(card, tmp_path)  # SF's own config agrees with the recipe
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, "shift": 8.0}))
    with pytest.raises(InvalidCard, match="shift 8.0 differs"):
        check_scheduler_config(card, tmp_path)


def test_wan_toy_causal_generates_through_the_facade_and_refuses_other_steps() -> None:
    torch.manual_seed(0)
    model = facade.load("wan-toy-causal")
    video = model.generate("a red square moves left", frames=9, seed=1)  # one chunk
    assert video.frames.shape == (9, 3, 64, 64)
    assert 0.0 <= float(video.frames.min()) and float(video.frames.max()) <= 1.0
    # Refused at validation (the loop's check_request), before any compute: a typed RecipeMismatch naming the field.
    with pytest.raises(RecipeMismatch, match=r"steps: card 'wan-toy-causal' .* assumes loop 'realtime' .*asked for 8 steps"):
        model.generate("a red square moves left", frames=9, steps=8)


def test_a_wan_toy_causal_session_streams_chunks_and_takes_a_prompt_update() -> None:
    """The card under the kernel's session runtime (fv.load(...).session): typed chunks with continuous frame
    ranges; an update sent after the first chunk reaches a later chunk (its prompt_version), never an earlier one."""
    model = facade.load("wan-toy-causal")
    chunks = []
    with model.session("a red square moves left", max_chunks=3, seed=2) as session:
        for chunk in session:
            chunks.append(chunk)
            if chunk.index == 0:
                assert session.update("a red square moves right") == 1
    assert [c.index for c in chunks] == [0, 1, 2]
    assert [tuple(c.frames.shape) for c in chunks] == [(1, 3, 64, 64), (4, 3, 64, 64), (4, 3, 64, 64)]  # 1-frame chunks
    assert chunks[0].prompt_version == 0 and chunks[-1].prompt_version == 1
    assert [c.prompt_version for c in chunks] == sorted(c.prompt_version for c in chunks)


def test_the_factory_checks_a_local_checkpoint_s_scheduler_shift(tmp_path: Path) -> None:
    from fv_kernel.api import InstanceOptions
    from fv_wan.causal import build_causal_wan_instance

    (card,) = causal_wan_cards()
    (tmp_path / "scheduler").mkdir()
    config = {"_class_name": "SelfForcingFlowMatchScheduler", "shift": 5.0}
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    instance = build_causal_wan_instance(card, InstanceOptions(source=str(tmp_path), device="cpu"))  # loads nothing yet
    pool = instance.block_pools()["chunk_kv"]
    assert pool.config.tokens_per_slab == 3 * 1560 and pool.capacity_slabs == 28 and pool.nbytes() == 0
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, "shift": 3.0}))
    with pytest.raises(InvalidCard, match="shift 3.0 differs"):
        build_causal_wan_instance(card, InstanceOptions(source=str(tmp_path), device="cpu"))


def test_wan_toy_causal_window_and_budget() -> None:
    card = wan_toy_causal_card()
    assert card is not None
    recipe = CausalRecipe(**card.loops["realtime"].config)
    assert (recipe.frames_per_chunk, recipe.sink_chunks, recipe.local_chunks) == (1, 1, 8)
    assert card.caches["chunk_kv"].budget_bytes == 8 * 9 * card.caches["chunk_kv"].block_bytes
