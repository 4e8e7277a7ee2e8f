"""C0 parity of the generator path against diffusers' Cosmos3OmniTransformer.

The diffusers side gets its packed inputs from the diffusers pipeline's own segment
builders (``Cosmos3OmniPipeline._prepare_*_segment``), so positions, FPS modulation,
noisy-frame bookkeeping and modality order are checked against the reference, not
against our own position code. CPU fp32, tiny config, seeded random weights;
tolerance max abs <= 1e-5 (conftest.ATOL).
"""

from __future__ import annotations

import pytest
import torch
from cosmos3_testutils import assert_close, build_model

from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT

diffusers = pytest.importorskip("diffusers")
from fv_cosmos3.diffusers_reference import diffusers_forward_kwargs, diffusers_transformer  # noqa: E402

TIMESTEP = 937.5


def _diffusers_model(config: Cosmos3Config, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    return diffusers_transformer(config, state)


def _diffusers_forward(model: torch.nn.Module, config: Cosmos3Config, input_ids: list[int], video: torch.Tensor, **kw):
    """Pack exactly as Cosmos3OmniPipeline.__call__ does (fv_cosmos3.diffusers_reference), then call the transformer."""
    kwargs = diffusers_forward_kwargs(model, config, input_ids, video, timestep=TIMESTEP, **kw)
    with torch.no_grad():
        video_pred, sound_pred, action_pred = model(**kwargs)
    return video_pred[0], None if sound_pred is None else sound_pred[0], None if action_pred is None else action_pred[0]


def _noisy(total: int, clean: list[int]) -> list[int]:
    return [i for i in range(total) if i not in clean]


@pytest.fixture(scope="module")
def setup(tiny_model):
    model, state = tiny_model
    gen = torch.Generator().manual_seed(11)
    data = dict(
        ids=torch.randint(0, 272, (1, 9), generator=gen),
        # H=5, W=6: H is not a multiple of the patch size, exercising pad + crop.
        video=torch.randn(1, 4, 3, 5, 6, generator=gen),
        sound=torch.randn(4, 7, generator=gen),
        action=torch.randn(4, 6, generator=gen),
    )
    return model, _diffusers_model(model.config, state), data


CASES = {
    "t2v": dict(fps=24.0, video_clean=[]),
    "i2v_fps16": dict(fps=16.0, video_clean=[0]),
    "t2v_sound": dict(fps=24.0, video_clean=[], sound=True),
    "action_policy": dict(fps=24.0, video_clean=[0], action=True, action_clean=[]),
    "action_forward_dynamics": dict(fps=24.0, video_clean=[0], action=True, action_clean=[0, 1, 2, 3]),
    "action_inverse_dynamics": dict(fps=10.0, video_clean=[0, 1, 2], action=True, action_clean=[]),
    "video_sound_action": dict(fps=30.0, video_clean=[0], sound=True, action=True, action_clean=[1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generator_matches_diffusers(setup, case):
    model, reference, data = setup
    spec = CASES[case]
    sound = data["sound"] if spec.get("sound") else None
    action = data["action"] if spec.get("action") else None
    action_clean = spec.get("action_clean", [])
    expected = _diffusers_forward(
        reference, model.config, data["ids"][0].tolist(), data["video"], fps=spec["fps"],
        video_condition_frames=spec["video_clean"], sound=sound, action=action, action_domain=2,
        action_condition_frames=action_clean,
    )
    with torch.no_grad():
        text_kv = model.text_kv_for_generation(data["ids"])
        out = model.generate_forward(
            text_kv, data["video"], TIMESTEP, fps=spec["fps"],
            video_noisy_frames=_noisy(3, spec["video_clean"]),
            sound_latents=sound,
            action=action, action_domain=2 if action is not None else None,
            action_noisy_frames=_noisy(4, action_clean) if action is not None else None,
        )
    if len(spec["video_clean"]) < 3:
        assert out.video.abs().max() > 1e-2  # non-degenerate where frames are noisy
    assert_close(out.video, expected[0])
    for frame in spec["video_clean"]:
        assert torch.count_nonzero(out.video[:, :, frame]) == 0
    if sound is None:
        assert out.sound is None and expected[1] is None
    else:
        assert_close(out.sound, expected[1])
    if action is None:
        assert out.action is None and expected[2] is None
    else:
        assert_close(out.action, expected[2])


def test_edge_variant_matches_diffusers():
    """Cosmos 3 Edge layout: relu2 MLP, Nemotron norms, no text q/k-norm, separate text k-norm for the generator."""
    config = Cosmos3Config.tiny(hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True, rms_norm_eps=1e-5)
    model, state = build_model(config, seed=5)
    reference = _diffusers_model(config, state)
    gen = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 272, (1, 6), generator=gen)
    video = torch.randn(1, 4, 2, 4, 4, generator=gen)
    action = torch.randn(3, 6, generator=gen)
    expected = _diffusers_forward(
        reference, config, ids[0].tolist(), video, fps=24.0, video_condition_frames=[0], action=action, action_domain=1,
    )
    with torch.no_grad():
        gen_kv = model.text_kv_for_generation(ids)
        out = model.generate_forward(gen_kv, video, TIMESTEP, video_noisy_frames=[1], action=action, action_domain=1)
        _, reasoner_kv = model.text_prefill(ids)
        with pytest.raises(ValueError, match="purpose"):
            model.generate_forward(reasoner_kv, video, TIMESTEP)
    assert_close(out.video, expected[0])
    assert_close(out.action, expected[2])
    # Values are shared; keys differ by the generator-only k-norm.
    for a, b in zip(gen_kv.values, reasoner_kv.values):
        assert torch.equal(a, b)
    assert (gen_kv.keys[0] - reasoner_kv.keys[0]).abs().max() > 1e-3


def test_cached_text_kv_equals_recompute_each_call(setup):
    model, _, data = setup
    with torch.no_grad():
        text_kv = model.text_kv_for_generation(data["ids"])
        for t in (999.0, 500.0, 20.0):
            cached = model.generate_forward(text_kv, data["video"], t, sound_latents=data["sound"])
            recomputed = model.generate_forward_recompute(data["ids"], data["video"], t, sound_latents=data["sound"])
            assert torch.equal(cached.video, recomputed.video)
            assert torch.equal(cached.sound, recomputed.sound)


def test_text_kv_for_generation_equals_prefill_kv(setup):
    model, _, data = setup
    with torch.no_grad():
        gen_kv = model.text_kv_for_generation(data["ids"])
        _, prefill_kv = model.text_prefill(data["ids"])
    assert gen_kv.length == prefill_kv.length == data["ids"].shape[1]
    for a, b in zip(gen_kv.keys + gen_kv.values, prefill_kv.keys + prefill_kv.values):
        assert torch.equal(a, b)
    # Nano/Super: the generator accepts the reasoner's own cache (shared weights).
    with torch.no_grad():
        a = model.generate_forward(gen_kv, data["video"], TIMESTEP)
        b = model.generate_forward(prefill_kv, data["video"], TIMESTEP)
    assert torch.equal(a.video, b.video)


def test_generate_forward_does_not_touch_text_tower(setup):
    """Given a cached K/V, no reasoner-tower weight is read."""
    model, _, data = setup
    with torch.no_grad():
        text_kv = model.text_kv_for_generation(data["ids"])
    calls: list[str] = []
    text_modules = {"embed_tokens": model.embed_tokens, "norm": model.norm, "lm_head": model.lm_head}
    for i, layer in enumerate(model.layers):
        for name in ("to_q", "to_k", "to_v", "to_out"):
            text_modules[f"layers.{i}.{name}"] = getattr(layer.self_attn, name)
        text_modules[f"layers.{i}.mlp"] = layer.mlp
        text_modules[f"layers.{i}.input_layernorm"] = layer.input_layernorm
    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: calls.append(n)) for n, m in text_modules.items()]
    try:
        with torch.no_grad():
            model.generate_forward(text_kv, data["video"], TIMESTEP, sound_latents=data["sound"])
    finally:
        for h in hooks:
            h.remove()
    assert calls == []


def test_generate_forward_input_errors(setup):
    model, _, data = setup
    with torch.no_grad():
        text_kv = model.text_kv_for_generation(data["ids"])
        with pytest.raises(ValueError, match="video_latents"):
            model.generate_forward(text_kv, data["video"][0], TIMESTEP)
        with pytest.raises(ValueError, match="action_domain"):
            model.generate_forward(text_kv, data["video"], TIMESTEP, action=data["action"])
        with pytest.raises(ValueError, match=r"action_domain must be in \[0, 3\)"):
            model.generate_forward(text_kv, data["video"], TIMESTEP, action=data["action"], action_domain=7)
        with pytest.raises(ValueError, match="video_noisy_frames"):
            model.generate_forward(text_kv, data["video"], TIMESTEP, video_noisy_frames=[5])
        no_sound = Cosmos3MoT(Cosmos3Config.tiny(sound_gen=False, sound_dim=None)).eval()
        with pytest.raises(ValueError, match="sound_gen"):
            no_sound.generate_forward(no_sound.text_kv_for_generation(data["ids"]), data["video"], TIMESTEP, sound_latents=data["sound"])


def test_timestep_sinusoid_is_cos_then_sin_of_scaled_t():
    from diffusers.models.embeddings import get_timestep_embedding

    from fv_cosmos3.models.layers import TimestepEmbedder

    t = torch.tensor([999.0, 437.5, 0.0]) * 0.001
    ours = TimestepEmbedder.sinusoid(t)
    theirs = get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    assert_close(ours, theirs)
    assert_close(ours[:, 0], torch.cos(t))  # slot 0 has frequency 1: cos comes first
