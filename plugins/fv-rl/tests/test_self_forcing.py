"""Self-Forcing: the causal rollout (KV cache, exit-step gradients), the training run, the export and its provenance."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import fv_rl.self_forcing as sf
import pytest
import torch
import torch.nn.functional as F
from fv_wan.models.transformer import WanTransformer, WanTransformerConfig

from fv_kernel.api import (
    InstanceOptions,
    RecipeError,
    SlabWindowSpec,
    build_instance,
    read_card_file_beside,
)
from fv_kernel.plugins import PluginHost
from fv_kernel.training.recipe import load_recipe
from fv_kernel.training.runner import run_training

CHUNK = (2, 16, 1, 4, 4)  # (B, C, latent frames, H, W) of one chunk


def _tiny(seed: int = 0) -> WanTransformer:
    torch.manual_seed(seed)
    return WanTransformer(WanTransformerConfig.tiny()).eval()


def _schedule() -> sf.CausalSchedule:
    return sf.CausalSchedule.of(sf.SelfForcingOptions())


def _context(model: WanTransformer, seed: int = 1) -> torch.Tensor:
    return torch.randn(CHUNK[0], 6, model.config.text_dim, generator=torch.Generator().manual_seed(seed))


def _block_causal_reference(model: WanTransformer, clean: list[torch.Tensor], x: torch.Tensor, t: float,
                            context: torch.Tensor) -> torch.Tensor:
    """The last chunk's prediction from ONE forward over [clean chunks at t=0, x at t] under a
    block-causal mask (a chunk's tokens see their own chunk and earlier ones): no KV cache."""
    sequence = torch.cat([*clean, x], dim=2)
    per_frame = (CHUNK[3] // 2) * (CHUNK[4] // 2)
    chunk_of = torch.arange(sequence.shape[2]).repeat_interleave(per_frame)
    mask = chunk_of[None, :] <= chunk_of[:, None]  # (q, k)
    timestep = torch.where(chunk_of == chunk_of[-1], t, 0.0).expand(x.shape[0], -1)

    def runner(m, h, inputs):
        masked = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for block in m.blocks:
            h = block(h, inputs, m.attention_fn, None, self_attention_fn=masked)
        return h

    return model(sequence, timestep, context, block_runner=runner)[:, :, -x.shape[2]:]


def _kv(model: WanTransformer, chunks: int = 3) -> sf.RolloutKV:
    return sf.RolloutKV(model, CHUNK, chunks, SlabWindowSpec(sink_slabs=0, local_slabs=chunks))


def test_chunk_forward_with_committed_kv_equals_one_block_causal_forward():
    model = _tiny()
    context = _context(model)
    g = torch.Generator().manual_seed(2)
    clean = [torch.randn(CHUNK, generator=g) for _ in range(2)]
    x = torch.randn(CHUNK, generator=g)
    with torch.no_grad(), _kv(model) as kv:
        for chunk in clean:
            sf.causal_forward(model, chunk, torch.zeros(2), context, kv, commit=True)
        assert kv.frames == 2
        got = sf.causal_forward(model, x, torch.full((2,), 625.0), context, kv)
        want = _block_causal_reference(model, clean, x, 625.0, context)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # negative controls: RoPE restarting at frame 0 for every chunk, and a stale (noisy) committed chunk
    with torch.no_grad():
        with _kv(model) as kv:
            for chunk in clean:
                sf.causal_forward(model, chunk, torch.zeros(2), context, kv, commit=True)
            kv.frames = 0
            assert (sf.causal_forward(model, x, torch.full((2,), 625.0), context, kv) - want).abs().max() > 1e-3
        with _kv(model) as kv:
            sf.causal_forward(model, clean[0], torch.zeros(2), context, kv, commit=True)
            sf.causal_forward(model, clean[1], torch.full((2,), 900.0), context, kv, commit=True)
            assert (sf.causal_forward(model, x, torch.full((2,), 625.0), context, kv) - want).abs().max() > 1e-3


def test_rollout_kv_lives_in_a_slab_pool_in_training_mode():
    """Each row's chunks attend through the served window (sink + local, oldest non-sink evicted), and no
    slab is recycled until the rollout ends: every chunk got its own slab; the pool is empty after."""
    model = _tiny()
    attended: list = []
    with torch.no_grad():
        sf.causal_rollout(model, [_context(model)] * 5, CHUNK, _schedule(), torch.Generator().manual_seed(0),
                          window=SlabWindowSpec(sink_slabs=1, local_slabs=2), attended=attended)
    (history,) = attended
    assert [a.positions for a in history] == [(0,), (0, 1), (0, 1, 2), (0, 2, 3), (0, 3, 4)]
    assert [a.evicted is not None for a in history] == [False, False, False, True, True]
    assert len({a.slab for a in history}) == 5  # an evicted chunk's slab is never handed to a later one
    kv = _kv(model, chunks=2)
    with kv:
        with torch.no_grad():
            sf.causal_forward(model, torch.zeros(CHUNK), torch.zeros(2), _context(model), kv, commit=True)
        assert kv.pool.used_slabs == CHUNK[0]
    assert kv.pool.used_slabs == 0


def _grad_forwards(model: WanTransformer, grad_chunks: frozenset[int], exit_step: int) -> tuple[list[bool], list]:
    """Rollout of 3 chunks; returns whether each transformer call ran with grad, and the chunks."""
    calls: list[bool] = []
    handle = model.patch_embedding.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    try:
        chunks = sf.causal_rollout(model.train().requires_grad_(True), [_context(model)] * 3, CHUNK, _schedule(),
                                   torch.Generator().manual_seed(0), exit_step=exit_step, grad_chunks=grad_chunks)
    finally:
        handle.remove()
    return calls, chunks


def _assert_grad_only_at_exit(calls: list[bool], exit_step: int, grad_chunks: frozenset[int], chunks: int = 3) -> None:
    per_chunk = exit_step + 2  # steps 0..exit, then the KV refresh
    assert len(calls) == chunks * per_chunk
    for chunk in range(chunks):
        mine = calls[chunk * per_chunk:(chunk + 1) * per_chunk]
        assert mine == [False] * exit_step + [chunk in grad_chunks] + [False], (chunk, mine)


def test_rollout_has_grad_only_through_the_exit_step_of_the_scored_chunks():
    model = _tiny()
    grad_chunks = frozenset({1, 2})
    calls, chunks = _grad_forwards(model, grad_chunks, exit_step=2)
    _assert_grad_only_at_exit(calls, 2, grad_chunks)
    assert chunks[0].grad_fn is None and chunks[1].grad_fn is not None and chunks[2].grad_fn is not None
    torch.cat(chunks[1:], dim=2).square().mean().backward()
    assert model.blocks[0].attn1.to_q.weight.grad.abs().sum() > 0


def test_rollout_grad_check_catches_a_grad_through_a_no_grad_step(monkeypatch):
    """Negative control: with every denoising step under grad the check above fails."""
    monkeypatch.setattr(sf, "_with_grad", lambda step, last, chunk, grad_chunks: True)
    model = _tiny()
    calls, _ = _grad_forwards(model, frozenset({1, 2}), exit_step=2)
    with pytest.raises(AssertionError):
        _assert_grad_only_at_exit(calls, 2, frozenset({1, 2}))


def test_inference_rollout_runs_all_steps_without_grad():
    model = _tiny()
    calls: list[bool] = []
    handle = model.patch_embedding.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    chunks = sf.causal_rollout(model, [_context(model)] * 2, CHUNK, _schedule(), torch.Generator().manual_seed(0))
    handle.remove()
    assert len(calls) == 2 * (4 + 1) and not any(calls)
    assert all(c.shape == CHUNK and c.grad_fn is None for c in chunks)


def test_switch_prompt_changes_only_the_first_objects_direction_and_avoids_held_out():
    from fv_wan.toy.grammar import is_held_out, parse_prompt

    g = torch.Generator().manual_seed(0)
    prompt = "a red square moves left quickly and a green circle moves up slowly on a black background"
    for _ in range(10):
        switched = parse_prompt(sf.switch_prompt(prompt, g))
        before = parse_prompt(prompt)
        assert switched.objects[0].direction != "left"
        assert switched.objects[0].colour == "red" and switched.objects[1] == before.objects[1]
        assert not is_held_out(switched.prompt())


def test_after_a_switch_the_windows_first_chunk_is_context_only():
    assert sf.scored_frames(0, 1) == slice(0, None) and sf.scored_frames(2, 1) == slice(1, None)
    assert sf.scored_frames(1, 3) == slice(3, None)


def test_world_clips_hold_plain_clips_and_bounces_with_the_reversed_prompt_first():
    from fv_wan.models.vae import WanVAE
    from fv_wan.toy.grammar import parse_prompt
    from fv_wan.toy_card import TOY_VAE

    torch.manual_seed(0)
    vae = WanVAE(TOY_VAE).eval()
    stage = sf.TeacherForcingStage(steps=1, clips=2, prefix_chunks=2)
    (plain, prompts), (bounce, before, after) = sf.world_clips(
        vae, stage, frames=5, height=32, width=32, frames_per_latent=4, chunk_frames=1)
    assert plain.shape[2] == 2 and len(prompts) == plain.shape[0]
    assert bounce.shape[2] == 2 + 1 and len(before) == len(after) == bounce.shape[0]  # 2 reversed chunks + 4 frames
    for a, b in zip(before, after):
        reversed_directions = [o.direction for o in parse_prompt(a).objects]
        opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
        assert reversed_directions == [opposite[o.direction] for o in parse_prompt(b).objects]


def test_an_already_distilled_card_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="already distilled"):
        run_training(_recipe(tmp_path, "wan-toy-causal", steps=1), tmp_path / "run", PluginHost(), progress=False)


def test_options_refuse_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="prompts"):
        sf.SelfForcingOptions(prompts=())
    with pytest.raises(ValueError, match="strictly decreasing"):
        sf.SelfForcingOptions(denoising_timesteps=(500.0, 750.0))
    with pytest.raises(ValueError, match="switch_prob"):
        sf.SelfForcingOptions(switch_prob=1.5)


def _recipe(tmp: Path, card: str, **options) -> Path:
    path = tmp / "sf.json"
    path.write_text(json.dumps({
        "method": "self_forcing", "card": card, "output_model_id": "wan-toy-causal-ci", "device": "cpu", "seed": 0,
        "options": {"prompt_source": "toy-world", "height": 32, "width": 32, "frames": 5, "batch": 2, "log_every": 1,
                    **options},
    }))  # fmt: skip
    return path


def test_bad_geometry_is_a_recipe_error_naming_the_field(tmp_path):
    with pytest.raises(RecipeError, match="chunk_frames") as info:
        run_training(_recipe(tmp_path, "wan-toy", steps=1, chunk_frames=3), tmp_path / "run", PluginHost(), progress=False)
    assert "options.chunk_frames" in str(info.value.param if hasattr(info.value, "param") else info.value)


def test_student_updates_through_the_exit_steps_lower_the_dmd_loss():
    """A tiny random student, its rollout (same noise each time), the critic taken as perfect (x0_fake = x0)
    and a fixed x0_real: the DMD updates through the exit steps pull the rollout to it, and the loss falls."""
    model = _tiny().train()
    target = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(5))
    context = _context(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        chunks = sf.causal_rollout(model, [context] * 3, CHUNK, _schedule(), torch.Generator().manual_seed(0),
                                   exit_step=1, grad_chunks=frozenset({0, 1, 2}))
        x0 = torch.cat(chunks, dim=2)
        loss = sf.SelfForcing().loss({"x0": x0, "x0_real": target, "x0_fake": x0.detach()})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float((x0.detach() - target).abs().mean()))
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < 0.95 * losses[0], losses


def test_teacher_forcing_loss_falls_on_a_fixed_batch():
    model = _tiny().train()
    latents = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(6))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(10):
        loss = sf.teacher_forcing_loss(model, latents, [_context(model)] * 3, 1, _schedule(), torch.Generator().manual_seed(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses


CI_RECIPE = Path(sf.__file__).resolve().parents[1] / "recipes" / "self_forcing_wan_toy-ci.yaml"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The CI recipe (both stages, a few steps at 32x32) through ``fv train``'s runner."""
    tmp = tmp_path_factory.mktemp("self_forcing")
    return run_training(CI_RECIPE, tmp / "run", PluginHost(), progress=False)


def test_export_is_a_card_with_recipe_and_provenance(exported):
    card = exported.card
    assert card.model_id == "wan-toy-causal-ci"
    assert (card.recipe.method, card.recipe.parents) == ("self_forcing", ("wan-toy",))
    assert "Self-Forcing (DMD) from teacher 'wan-toy'" in card.recipe.data_contract
    provenance = json.loads((exported.checkpoint.parent / sf.PROVENANCE_FILE).read_text())
    assert provenance["teacher"]["model_id"] == "wan-toy" and len(provenance["teacher"]["transformer_sha256"]) == 64
    assert provenance["steps"]["self_forcing"] == 4 and provenance["steps"]["teacher_forcing"] == 2
    assert provenance["recipe"]["method"] == "self_forcing" and exported.log.curves["teacher_forcing"]["flow"]
    assert provenance["teacher"]["transformer_sha256"][:16] in card.recipe.data_contract


def test_the_export_is_a_causal_card_that_streams_a_session(exported):
    """The card written beside a student's weights serves them causally (serve_as): its only loop is the
    chunk rollout with the recipe's sampler and chunking, the recipe assumes it, and ``fv.load`` of the
    export streams a session. The teacher's loops would run the student bidirectionally."""
    import fv_kernel as fv
    from fv_wan.causal import CausalRecipe

    card = read_card_file_beside(exported.checkpoint)
    options = sf.SelfForcingOptions(**load_recipe(CI_RECIPE).options)
    assert set(card.loops) == {"realtime"} and card.recipe.assumes_loop == "realtime"
    assert card.factory == "fv_wan.causal:build_causal_toy_instance" and "chunk_kv" in card.caches
    recipe = CausalRecipe(**card.loops["realtime"].config)
    assert (recipe.frames_per_chunk, recipe.sink_chunks, recipe.local_chunks) == (
        options.chunk_frames, options.sink_chunks, options.local_chunks)
    assert recipe.denoising_steps == options.denoising_timesteps and recipe.max_sequence_length == 24
    assert card.capabilities.defaults.steps == len(options.denoising_timesteps) and card.recipe.envelope is not None
    with fv.load(str(exported.checkpoint / "fv-card.json")).session(
        "a red square moves left quickly on a black background", max_chunks=2) as session:
        chunks = list(session)
    assert [c.frames.shape[0] for c in chunks] == [1, 4] and all(torch.isfinite(c.frames).all() for c in chunks)


#: Decoded frames in [0, 1], fp32 CPU: training rollout vs the card's session over 11 chunks, measured <= 9e-6
#: (batched serving forward vs the rollout's, a whole decode vs the streamed one); attending past the window
#: (every chunk kept) moves the frames by > 0.1 once a chunk leaves it.
TRAIN_VS_SERVE = 5e-5


def _training_rollout_videos(card, prompt: str, seed: int, chunks: int,
                             windows: list[SlabWindowSpec | None]) -> list[torch.Tensor]:
    """The decoded video (F, 3, H, W) of a training rollout through each of ``windows``, one instance for all."""
    from fv_rl.flow_matching import context_length_of
    from fv_wan.causal import CausalRecipe

    host = PluginHost()
    host.start()
    instance = build_instance(card, InstanceOptions(device="cpu", precision="fp32", registry=host.registry()))
    transformer, vae = instance.component("transformer").eval(), instance.component("vae_decoder")
    recipe = CausalRecipe(**card.loops["realtime"].config)
    context = instance.component("text_encoder").encode([prompt], context_length_of(card)).float()
    scale = card.capabilities.token_grid.pixels_per_token // transformer.config.patch_size[1]
    defaults = card.capabilities.defaults
    shape = (1, transformer.config.in_channels, recipe.frames_per_chunk, defaults.height // scale, defaults.width // scale)
    schedule = sf.CausalSchedule.of(sf.SelfForcingOptions(
        chunk_frames=recipe.frames_per_chunk, denoising_timesteps=recipe.denoising_steps, timestep_shift=recipe.shift))
    videos = []
    for window in windows:
        with torch.no_grad():
            latents = torch.cat(sf.causal_rollout(transformer, [context] * chunks, shape, schedule,
                                                  torch.Generator().manual_seed(seed), window=window), dim=2)
            pixels = vae.decode(vae.denormalize_latents(latents))
        videos.append(((pixels + 1) / 2).clamp(0, 1)[0].transpose(0, 1))
    return videos


def test_a_training_rollout_past_the_served_window_is_the_cards_session():
    """Training attends as serving does, past the window too: wan-toy-causal's session (its realtime loop
    and slab pool) and a training rollout (RolloutKV) on the same weights, seed and prompt give the same
    video over sink + local + 2 chunks. The negative control keeps every chunk in the rollout's window."""
    import fv_kernel as fv
    from fv_wan.causal import CausalRecipe

    card = read_card_file_beside(Path(__import__("fv_wan").__file__).parent / "weights" / "wan-toy-causal")
    recipe = CausalRecipe(**card.loops["realtime"].config)
    chunks = recipe.sink_chunks + recipe.local_chunks + 2
    prompt = "a red circle moves left quickly on a black background"
    with fv.load("wan-toy-causal").session(prompt, seed=3, max_chunks=chunks) as session:
        served = torch.cat([chunk.frames for chunk in session])
    window = SlabWindowSpec(sink_slabs=recipe.sink_chunks, local_slabs=recipe.local_chunks)
    trained, unwindowed = _training_rollout_videos(card, prompt, 3, chunks, [window, None])
    assert trained.shape == served.shape
    assert (trained - served).abs().max() <= TRAIN_VS_SERVE
    inside = 1 + 4 * (recipe.frames_per_chunk * (recipe.sink_chunks + recipe.local_chunks) - 1)  # chunks that fit the window
    assert (unwindowed[:inside] - served[:inside]).abs().max() <= TRAIN_VS_SERVE
    assert (unwindowed - served).abs().max() > 100 * TRAIN_VS_SERVE


def test_exported_weights_load_as_a_card_and_are_the_student(exported):
    card = read_card_file_beside(exported.checkpoint)
    host = PluginHost()
    host.start()
    instance = build_instance(card, InstanceOptions(device="cpu", precision="fp32", registry=host.registry()))
    loaded = instance.component("transformer")
    teacher = build_instance(read_card_file_beside(Path(__import__("fv_wan").__file__).parent / "weights" / "wan-toy"),
                             InstanceOptions(device="cpu", precision="fp32", registry=host.registry()))
    assert sf.weights_digest(loaded) != sf.weights_digest(teacher.component("transformer"))
    with torch.no_grad():
        chunks = sf.causal_rollout(loaded, [instance.component("text_encoder").encode(["a red square moves left quickly on a black background"], 24)] * 2,
                                   (1, 16, 1, 8, 8), _schedule(), torch.Generator().manual_seed(0))
    assert torch.isfinite(torch.cat(chunks, dim=2)).all()


def _safetensors_digest(path: Path) -> str:
    from safetensors.torch import load_file

    return sf.weights_digest(_Named(load_file(str(path))))


class _Named(torch.nn.Module):
    """A module whose state dict is exactly the given tensors (names with dots kept)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        return dict(self._tensors)


WEIGHTS = Path(__import__("fv_wan").__file__).parent / "weights"


def test_shipped_wan_toy_causal_weights_are_small_and_carry_their_provenance():
    root = WEIGHTS / "wan-toy-causal"
    files = [p for p in root.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 25 * 1024 * 1024
    provenance = json.loads((root / sf.PROVENANCE_FILE).read_text())
    assert provenance["method"] == "self_forcing" and provenance["teacher"]["model_id"] == "wan-toy"
    assert provenance["git_commit"] and provenance["steps"]["self_forcing"] > 0
    card = read_card_file_beside(root)
    assert card.model_id == "wan-toy-causal" and card.recipe.method == "self_forcing"
    # the teacher digest is wan-toy's shipped transformer; the student's differs (negative control)
    teacher = _safetensors_digest(WEIGHTS / "wan-toy" / "transformer" / "diffusion_pytorch_model.safetensors")
    student = _safetensors_digest(root / "transformer" / "diffusion_pytorch_model.safetensors")
    assert provenance["teacher"]["transformer_sha256"] == teacher != student


def test_the_wan_toy_causal_card_serves_the_shipped_weights_with_their_chunking():
    from fv_wan.causal import CausalRecipe
    from fv_wan.toy_card import causal_weights_dir, wan_toy_causal_card

    card = wan_toy_causal_card()
    provenance = json.loads((causal_weights_dir() / sf.PROVENANCE_FILE).read_text())
    assert card.checkpoint.source == str(causal_weights_dir()) and card.recipe.method == "self_forcing"
    recipe = CausalRecipe(**card.loops["realtime"].config)
    assert recipe.frames_per_chunk == provenance["recipe"]["options"]["chunk_frames"]
    # the sampler the student was trained with is the one the card serves
    assert sf.CausalSchedule.of(sf.SelfForcingOptions()).timesteps.tolist() == pytest.approx(list(recipe.timesteps), abs=1e-3)


def test_the_causal_cards_prompt_context_is_its_realtime_loops_length():
    """A causal card has no ``text_encode`` loop: its ``realtime`` loop encodes prompts at its recipe's
    ``max_sequence_length`` (24 for wan-toy-causal). Reading Wan's default 512 there fed the reference
    evaluation (bench/eval_toy_causal.py --backend reference) rows that serving never builds."""
    from fv_rl.flow_matching import context_length_of
    from fv_wan.toy_card import TOY_CONTEXT_LENGTH, wan_toy_causal_card

    card = wan_toy_causal_card()
    if card is None:
        pytest.skip("wan-toy-causal's weights are not installed")
    assert "text_encode" not in card.loops
    assert context_length_of(card) == card.loops["realtime"].config["max_sequence_length"] == TOY_CONTEXT_LENGTH
    clash = card.model_copy(update={"loops": {
        **card.loops, "other": card.loops["realtime"].model_copy(update={"config": {
            **card.loops["realtime"].config, "max_sequence_length": 32}})}})
    with pytest.raises(ValueError, match="different lengths"):
        context_length_of(clash)


def _transformer_digest(checkpoint: Path) -> str:
    return _safetensors_digest(checkpoint / "transformer" / "diffusion_pytorch_model.safetensors")


def test_a_run_continues_an_earlier_student(exported, tmp_path):
    """``init_student``: the student starts from an earlier export, not the teacher. One step with no
    student update (critic first) exports the earlier student unchanged; the same run without it exports
    the teacher's weights (negative control)."""
    recipe = load_recipe(CI_RECIPE)
    options = {**recipe.options, "teacher_forcing": None, "steps": 1}
    earlier = _transformer_digest(exported.checkpoint)
    again = run_training(recipe.model_copy(update={"options": {**options, "init_student": str(exported.checkpoint.parent)}}),
                         tmp_path / "again", PluginHost(), progress=False)
    assert _transformer_digest(again.checkpoint) == earlier
    provenance = json.loads((again.checkpoint.parent / sf.PROVENANCE_FILE).read_text())
    assert provenance["continued_from"]["transformer_sha256"] == earlier
    assert provenance["continued_from"]["steps"] == {"teacher_forcing": 2, "self_forcing": 4, "student_updates": 2}
    assert f"continued from an earlier student (transformer sha256 {earlier[:16]}" in again.card.recipe.data_contract
    fresh = run_training(recipe.model_copy(update={"options": options}), tmp_path / "fresh", PluginHost(), progress=False)
    teacher = _transformer_digest(WEIGHTS / "wan-toy")
    assert _transformer_digest(fresh.checkpoint) == teacher != earlier


def test_init_student_must_be_an_export_of_this_teacher(exported, tmp_path):
    recipe = load_recipe(CI_RECIPE)
    with pytest.raises(RecipeError, match="options.init_student.*not a self_forcing export"):
        run_training(recipe.model_copy(update={"options": {**recipe.options, "init_student": str(tmp_path)}}),
                     tmp_path / "run", PluginHost(), progress=False)
    forged = tmp_path / "forged"
    import shutil

    shutil.copytree(exported.checkpoint.parent, forged)
    provenance = json.loads((forged / sf.PROVENANCE_FILE).read_text())
    provenance["teacher"]["transformer_sha256"] = "0" * 64
    (forged / sf.PROVENANCE_FILE).write_text(json.dumps(provenance))
    with pytest.raises(RecipeError, match="not distilled by self_forcing from this teacher"):
        run_training(recipe.model_copy(update={"options": {**recipe.options, "init_student": str(forged)}}),
                     tmp_path / "run2", PluginHost(), progress=False)
