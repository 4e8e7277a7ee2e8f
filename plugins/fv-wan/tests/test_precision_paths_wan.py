"""Wan cards' precision paths: what each path quantizes and which attention it runs, and the cards'
contracts."""

from __future__ import annotations

import pytest
import torch
from fv_wan.fp8 import WAN_FP8_MAX_JUDGE_DELTA, WAN_FP8_MIN_PSNR_DB, WAN_FP8_TARGETS

from fv_kernel.api import (
    Fp8Linear,
    InstanceOptions,
    InvalidRequest,
    build_instance,
)

FP8_PATHS = ("fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all")
NATIVE_LINEARS = ("condition_embedder.time_proj", "condition_embedder.time_embedder.linear_1",
                  "condition_embedder.text_embedder.linear_2", "proj_out")


def test_every_wan_card_lists_the_fp8_paths_and_targets_its_transformers(wan_card) -> None:
    from fv_wan.cards import wan_cards

    for card in wan_cards():
        dits = {c for c, spec in card.components.items() if spec.kind == "dit"}
        assert set(card.precision.fp8_targets) == dits and all(t == WAN_FP8_TARGETS for t in card.precision.fp8_targets.values())
        assert tuple(card.precision.paths) == FP8_PATHS
        assert all(c.min_psnr_db == WAN_FP8_MIN_PSNR_DB and c.max_judge_delta is None for c in card.precision.paths.values())


def test_wan_toy_contract_bounds_the_judge(wan_card) -> None:
    from fv_wan.toy_card import wan_toy_card

    card = wan_toy_card()
    if card is None:
        pytest.skip("wan-toy's weights are not installed")
    assert all(c.max_judge_delta == WAN_FP8_MAX_JUDGE_DELTA == 2.0 for c in card.precision.paths.values())


def _dit(card, path: str):
    instance = build_instance(card, InstanceOptions(precision_path=path))
    return instance, instance.component("transformer")


@pytest.mark.parametrize("path", ["native", *FP8_PATHS])
def test_each_path_quantizes_the_targets_and_picks_the_attention(wan_card, path) -> None:
    card = wan_card("wan-tiny")
    instance, model = _dit(card, path)
    assert instance.precision_path == path
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    if path in ("fp8_weights", "fp8_dynamic", "fp8_all"):
        assert len(fp8) == 10 * len(model.blocks) and "blocks.0.attn2.to_out.0" in fp8 and "blocks.1.ffn.net.0.proj" in fp8
        assert {m.mode for m in fp8.values()} == {"fp8_weights" if path == "fp8_weights" else "fp8_dynamic"}
    else:
        assert not fp8
    for name in NATIVE_LINEARS:
        assert type(model.get_submodule(name)) is torch.nn.Linear
    assert model.blocks[0].scale_shift_table.dtype == torch.float32
    assert (instance.options.attention_backend == "fp8") == (path in ("fp8_attention", "fp8_all"))
    from fv_kernel.compute.fp8_attention import Fp8Attention

    driver = getattr(model.attention_fn, "__self__", None)
    assert isinstance(driver, Fp8Attention) == (path in ("fp8_attention", "fp8_all")), model.attention_fn


def test_an_fp8_path_changes_the_forward_a_little(wan_card) -> None:
    """Each fp8 path really runs in fp8 (differs from native) and stays close (one forward, tiny Wan)."""
    card = wan_card("wan-tiny")
    _, native = _dit(card, "native")
    g = torch.Generator().manual_seed(0)
    c = native.config
    args = (torch.randn(1, c.in_channels, 2, 8, 8, generator=g), torch.tensor([500.0]), torch.randn(1, 8, c.text_dim, generator=g))
    with torch.no_grad():
        want = native(*args)
        for path in ("fp8_weights", "fp8_dynamic"):
            got = _dit(card, path)[1](*args)
            rel = ((got - want).norm() / want.norm()).item()
            assert 0 < rel < 0.1, (path, rel)


def test_a_path_the_card_does_not_list_is_refused(wan_card) -> None:
    card = wan_card("wan-tiny")
    bare = card.model_copy(update={"precision": card.precision.model_copy(update={"paths": {}})})
    with pytest.raises(InvalidRequest, match="precision_path.*allowed: native"):
        build_instance(bare, InstanceOptions(precision_path="fp8_weights"))
