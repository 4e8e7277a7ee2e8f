"""C0 parity of the reasoner (text) path against transformers' Cosmos3OmniForConditionalGeneration.

CPU fp32, tiny config, seeded random weights; tolerance max abs <= 1e-5 (conftest.ATOL).
"""

from __future__ import annotations

import pytest
import torch
from cosmos3_testutils import assert_close

from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT, TextKV, to_transformers_reasoner_state_dict
from fv_cosmos3.models.positions import text_positions

transformers = pytest.importorskip("transformers")


def _transformers_reasoner(config: Cosmos3Config, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    hf_config = transformers.Cosmos3OmniConfig(
        text_config=dict(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=config.rope_theta,
                mrope_section=list(config.rope_axes_dim),
                mrope_interleaved=True,
            ),
        ),
        # The ViT is unused by text-only parity; keep it minimal.
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=config.hidden_size,
            patch_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[],
        ),
    )
    hf_config._attn_implementation = "eager"
    torch.manual_seed(1)
    model = transformers.Cosmos3OmniForConditionalGeneration(hf_config).eval()
    mapped = to_transformers_reasoner_state_dict(state)
    result = model.load_state_dict(mapped, strict=False)
    assert result.unexpected_keys == []
    assert all(k.startswith("model.visual.") for k in result.missing_keys), result.missing_keys
    return model


@pytest.fixture(scope="module")
def pair(tiny_model):
    model, state = tiny_model
    return model, _transformers_reasoner(model.config, state)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 272, (2, 11), generator=torch.Generator().manual_seed(3))


def test_prefill_logits_match_transformers(pair, prompt):
    model, hf = pair
    positions = text_positions(prompt.shape[1]).unsqueeze(1).expand(3, prompt.shape[0], -1)
    with torch.no_grad():
        ours, _ = model.text_prefill(prompt, all_logits=True)
        theirs = hf(input_ids=prompt, position_ids=positions, use_cache=False).logits
        theirs_default_pos = hf(input_ids=prompt, use_cache=False).logits
    assert ours.abs().max() > 1e-2  # non-degenerate logits
    assert_close(ours, theirs)
    assert_close(ours, theirs_default_pos)


def test_prefill_logits_match_with_distinct_axis_positions(pair, prompt):
    """Non-(i,i,i) ids exercise the interleaved t/h/w frequency layout (a uniform shift would not)."""
    model, hf = pair
    n = prompt.shape[1]
    t = torch.arange(n) + 37
    h = (torch.arange(n) * 3) % 5
    w = (torch.arange(n) * 7) % 4
    positions = torch.stack([t, h, w]).unsqueeze(1).expand(3, prompt.shape[0], -1)
    with torch.no_grad():
        ours, _ = model.text_prefill(prompt, positions, all_logits=True)
        theirs = hf(input_ids=prompt, position_ids=positions, use_cache=False).logits
        text_only, _ = model.text_prefill(prompt, all_logits=True)
    assert_close(ours, theirs)
    assert (ours - text_only).abs().max() > 1e-3  # the h/w axes actually matter


def test_incremental_decode_equals_full_recompute(tiny_model, prompt):
    model, _ = tiny_model
    steps = 4
    continuation = torch.randint(0, 272, (2, steps), generator=torch.Generator().manual_seed(4))
    full = torch.cat([prompt, continuation], dim=1)
    with torch.no_grad():
        full_logits, full_kv = model.text_prefill(full, all_logits=True)
        logits, kv = model.text_prefill(prompt)
        assert_close(logits[:, -1], full_logits[:, prompt.shape[1] - 1])
        for i in range(steps):
            logits, kv = model.text_decode_step(continuation[:, i : i + 1], kv)
            assert_close(logits[:, -1], full_logits[:, prompt.shape[1] + i])
        # A multi-token extension uses an explicit offset-causal mask.
        _, kv_short = model.text_prefill(prompt)
        chunk_logits, kv_chunk = model.text_decode_step(continuation, kv_short, all_logits=True)
    assert_close(chunk_logits, full_logits[:, prompt.shape[1] :])
    assert kv.length == full.shape[1] == kv_chunk.length
    for a, b in zip(kv.keys + kv.values, full_kv.keys + full_kv.values):
        assert_close(a, b)


def test_text_kv_api(tiny_model, prompt):
    model, _ = tiny_model
    with torch.no_grad():
        _, kv = model.text_prefill(prompt)
    assert kv.num_layers == model.config.num_hidden_layers
    assert kv.keys[0].shape == (2, model.config.num_key_value_heads, prompt.shape[1], model.config.head_dim)
    head, tail = kv.slice(0, 5), kv.slice(5)
    rebuilt = head.append(tail)
    for a, b in zip(rebuilt.keys + rebuilt.values, kv.keys + kv.values):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="slice"):
        kv.slice(3, 3)
    with pytest.raises(ValueError, match="layers"):
        TextKV(keys=kv.keys[:1], values=kv.values)


def test_decode_rejects_kv_of_other_model(tiny_model, prompt):
    model, _ = tiny_model
    other = Cosmos3MoT(Cosmos3Config.tiny(num_hidden_layers=2)).eval()
    with torch.no_grad():
        _, kv = other.text_prefill(prompt)
        with pytest.raises(ValueError, match="layers"):
            model.text_decode_step(prompt[:, :1], kv)
