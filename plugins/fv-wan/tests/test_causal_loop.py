"""The causal Wan chunk rollout: recipe, prompt updates at chunk boundaries, suspend/resume, the pool, the cards."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_kernel.api import InvalidRequest, LoopContext, RecipeMismatch, StepResult
from fv_wan.causal import CausalRecipe, CausalWanState, warp_timesteps

from test_causal_parity import SIZE, generated_latents, make_request, run_loop, tiny_instance

CARD = "wan-tiny-causal"


def _ctx(request: Any) -> LoopContext:
    return LoopContext(request=request, executor=None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- recipe


def test_warp_matches_self_forcing_scheduler_numbers() -> None:
    assert warp_timesteps([1000, 750, 500, 250], 5.0) == pytest.approx([1000.0, 937.5, 833.333333, 625.0], abs=1e-5)
    # Without warping (CausVid-style configs) the steps are used as given.
    recipe = CausalRecipe(max_height=SIZE, max_width=SIZE, warp_denoising_step=False, denoising_steps=(1000, 757, 522))
    assert recipe.timesteps == (1000.0, 757.0, 522.0)


def test_recipe_refuses_bad_steps() -> None:
    with pytest.raises(ValueError, match="denoising_steps must decrease"):
        CausalRecipe(max_height=SIZE, max_width=SIZE, denoising_steps=(250, 500))


@pytest.mark.parametrize(("field", "diffusion"), [
    ("steps", {"steps": 8}), ("sampler", {"sampler": "euler"}), ("guidance", {"guidance": 5.0}),
])
def test_other_steps_sampler_or_cfg_is_a_recipe_mismatch(field: str, diffusion: dict[str, Any]) -> None:
    instance = tiny_instance()
    request = make_request(CARD, **diffusion)
    with pytest.raises(RecipeMismatch) as info:
        instance.loop("realtime").init(request, instance, _ctx(request))
    assert info.value.param == field
    assert "self_forcing_dmd" in str(info.value) and "4 steps" in str(info.value)


def test_engine_validation_refuses_other_steps_before_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's ``check_request`` runs at validation (every request and session), not only in ``init``."""
    from fv_kernel.api import Engine, SchedulerConfig
    from fv_wan.causal import CausalWanRolloutLoop

    engine = Engine(SchedulerConfig())
    engine.add_instance(tiny_instance())
    with pytest.raises(RecipeMismatch) as info:
        engine.validate(make_request(CARD, steps=8))
    assert info.value.param == "steps" and engine.queue_depth() == 0
    with pytest.raises(InvalidRequest) as size:
        engine.validate(make_request(CARD, steps=4, guidance=1.0, height=SIZE * 2))
    assert size.value.param == "height"
    # Negative control: without the hook, validation lets the same request through to admission.
    monkeypatch.setattr(CausalWanRolloutLoop, "check_request", lambda self, request, model: None)
    assert engine.validate(make_request(CARD, steps=8)).diffusion.steps == 8


def test_the_recipe_s_own_steps_and_sampler_are_accepted() -> None:
    instance = tiny_instance()
    request = make_request(CARD, steps=4, sampler="fv-wan/self_forcing_dmd", guidance=1.0)
    state = instance.loop("realtime").init(request, instance, _ctx(request))
    assert state.phase == "text" and state.window.positions == (0,)
    instance.loop("realtime").release(state.request_id, instance)


@pytest.mark.parametrize(("field", "diffusion"), [("height", {"height": 64}), ("width", {"width": 24})])
def test_frame_size_outside_the_slabs_is_refused(field: str, diffusion: dict[str, Any]) -> None:
    instance = tiny_instance()
    request = make_request(CARD, **diffusion)
    with pytest.raises(InvalidRequest) as info:
        instance.loop("realtime").init(request, instance, _ctx(request))
    assert info.value.param == field


def test_more_chunks_than_rope_positions_is_refused() -> None:
    instance = tiny_instance()  # the tiny transformer's RoPE table holds 32 latent frames: 10 chunks
    request = make_request(CARD, frames=1 + 4 * (3 * 11 - 1))
    with pytest.raises(InvalidRequest) as info:
        instance.loop("realtime").init(request, instance, _ctx(request))
    assert info.value.param == "max_chunks"


def test_estimate_reserves_the_window_in_the_pool() -> None:
    instance = tiny_instance(sink=1, local=2)
    estimate = instance.loop("realtime").estimate(make_request(CARD), instance)
    assert estimate.pool_blocks == {"chunk_kv": 3}


def test_estimate_prices_a_second_decode_a_chunk_when_previews_are_asked() -> None:
    from fv_kernel.api import OutputSpec, WorkKind

    instance = tiny_instance()
    loop = instance.loop("realtime")
    plain = make_request(CARD)
    previews = plain.model_copy(update={"output": OutputSpec(stream_previews=True)})

    def decodes(request: Any) -> int:
        return sum(s.count for s in loop.estimate(request, instance).steps if s.kind == WorkKind.VAE_TILE)

    assert (decodes(plain), decodes(previews)) == (1, 2)


# --------------------------------------------------------------------------- the rollout


def test_chunks_are_ready_in_order_with_frame_ranges_and_a_video_artifact() -> None:
    instance = tiny_instance()
    state, plans = run_loop(instance, make_request(CARD, frames=25))  # 7 latent frames: 3 chunks, trimmed to 25
    assert [(c.chunk_index, c.frame_start, c.num_frames) for c in state.ready] == [(0, 0, 9), (1, 9, 12), (2, 21, 12)]
    assert all(0.0 <= float(c.frames.min()) and float(c.frames.max()) <= 1.0 for c in state.ready)
    ops = [p.op for p in plans]
    # one text encode, then per chunk: 4 denoise forwards, the decode, the commit (the last chunk's is skipped)
    chunk = ["causal_forward"] * 4 + ["vae_decode_chunk"]
    assert ops == ["encode_text"] + (chunk + ["causal_forward"]) * 2 + chunk
    assert [bool(p.inputs["commit"]) for p in plans if p.op == "causal_forward"] == ([False] * 4 + [True]) * 2 + [False] * 4
    assert [p.inputs["timestep"].item() for p in plans if p.op == "causal_forward"][:5] == pytest.approx(
        [1000.0, 937.5, 833.3333, 625.0, 0.0], abs=1e-3)
    video = instance.loop("realtime").finalize(state).artifacts[0]
    assert video.frames.shape == (25, 3, SIZE, SIZE)


def _refresh_first(instance: Any, request: Any, state: Any = None) -> tuple[Any, list[Any]]:
    """The loop driven in Self-Forcing's order (each chunk's KV refresh before its decode), which a state
    suspended by an earlier fv-wan resumes in: every fresh chunk is put at its refresh first."""
    loop = instance.loop("realtime")
    state = loop.init(request, instance, _ctx(request)) if state is None else state
    plans = []
    while True:
        if state.phase == "decode" and not state.chunk_decoded and not state.kv_refreshed:
            state = state.model_copy(update={"phase": "commit"})
        plan = loop.next(state)
        if not hasattr(plan, "op"):
            return state, plans
        plans.append(plan)
        state = loop.advance(state, StepResult(outputs=instance.op(plan.op).fn(plan.inputs, plan.params)))


def test_decoding_before_the_refresh_changes_no_frame_and_no_committed_kv() -> None:
    """The chunk's decode reads nothing its KV refresh writes: run in either order (the refresh-first order is
    what an older suspended state resumes in), the frames and every slab's K/V are the same bits."""
    request = make_request(CARD, frames=25)
    decode_first, refresh_first = tiny_instance(), tiny_instance()
    state_a, plans_a = run_loop(decode_first, request)
    state_b, plans_b = _refresh_first(refresh_first, request)
    assert [p.op for p in plans_b][:7] == ["encode_text"] + ["causal_forward"] * 5 + ["vae_decode_chunk"]
    assert len(plans_b) == len(plans_a) + 1  # the refresh-first order commits the last chunk too
    assert [(c.chunk_index, c.frame_start) for c in state_a.ready] == [(c.chunk_index, c.frame_start) for c in state_b.ready]
    assert all(torch.equal(a.frames, b.frames) for a, b in zip(state_a.ready, state_b.ready))
    pool_a, pool_b = (instance.block_pools()["chunk_kv"] for instance in (decode_first, refresh_first))
    assert state_a.chunk_index == state_b.chunk_index == 3
    for layer in range(pool_a.config.num_layers):  # chunks 0 and 1: what chunk 2 attended to
        (ka, va), (kb, vb) = pool_a.read(state_a.window, layer, upto=2), pool_b.read(state_b.window, layer, upto=2)
        assert ka.shape[0] == 2 * pool_a.config.tokens_per_slab
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_the_last_chunk_skips_its_refresh_and_a_stream_cancel_after_a_decode_keeps_the_chunk() -> None:
    instance = tiny_instance()
    loop = instance.loop("realtime")
    request = make_request(CARD, frames=25)
    state, _ = run_loop(instance, request, until_chunk=1)
    state, _ = _steps(instance, state, 5)  # chunk 1: four denoise steps and its decode
    assert (state.phase, state.chunk_decoded, state.kv_refreshed) == ("commit", True, False)
    state, taken = loop.take_ready(state)
    assert [c.chunk_index for c in taken] == [0, 1]
    decoded = state
    state = loop.cancel_stream(state)  # chunk 1 was taken: its refresh finishes it, chunk 2 follows
    assert state.phase == "commit" and state.chunk_index == 1
    state, rest = run_loop(instance, request, state=state)
    assert [(c.chunk_index, c.frame_start) for c in state.ready] == [(2, 21)]  # no gap, no repeat
    # chunk 1's refresh, then chunk 2 (the last of 3): four denoise forwards and no refresh
    assert [bool(p.inputs["commit"]) for p in rest if p.op == "causal_forward"] == [True] + [False] * 4
    # Negative control: a state that does not know its chunk was decoded restarts it, and chunk 1 would be
    # generated and emitted a second time, decoded from a VAE cache already past it.
    restarted = loop.cancel_stream(decoded.model_copy(update={"chunk_decoded": False}))
    assert (restarted.phase, restarted.chunk_index) == ("denoise", 1)
    # A decoded chunk not yet taken stays ready (it is not generated again: dropping it would leave a gap).
    assert [c.chunk_index for c in loop.cancel_stream(decoded.model_copy(update={"ready": taken})).ready] == [1]


def test_renoise_draws_fresh_noise_each_step() -> None:
    """Two steps' inputs of one chunk are not on one ODE path: the re-noise uses new Gaussian noise."""
    instance = tiny_instance()
    _, plans = run_loop(instance, make_request(CARD, frames=9))
    xs = [p.inputs["latents"] for p in plans if p.op == "causal_forward"]
    x0 = next(p.inputs["z"] for p in plans if p.op == "vae_decode_chunk")  # the chunk's clean latents
    ts = [1.0, 0.9375, 0.8333333, 0.625]
    # x_t = (1 - s) x0 + s eps: the implied eps of consecutive steps are uncorrelated, not equal.
    eps = [(xs[i] - (1 - ts[i]) * x0) / ts[i] for i in (1, 2)]
    corr = torch.corrcoef(torch.stack([eps[0].flatten(), eps[1].flatten()]))[0, 1]
    assert abs(float(corr)) < 0.5


def _steps(instance: Any, state: Any, count: int) -> tuple[Any, list[Any]]:
    loop, plans = instance.loop("realtime"), []
    for _ in range(count):
        plan = loop.next(state)
        plans.append(plan)
        state = loop.advance(state, StepResult(outputs=instance.op(plan.op).fn(plan.inputs, plan.params)))
    return state, plans


def test_prompt_update_applies_at_the_next_chunk_boundary() -> None:
    instance = tiny_instance(prompt_update="boundary")
    loop = instance.loop("realtime")
    request = make_request(CARD)
    state, _ = run_loop(instance, request, until_chunk=1)
    state, _ = _steps(instance, state, 1)  # queued while chunk 1 is being generated (after its first denoise step)
    context_before = state.context
    state = loop.update_prompt(state, "a blue cube", 1)
    state, plans = run_loop(instance, request, state=state)
    assert [c.prompt_version for c in state.ready] == [0, 0, 1]  # chunk 1 was under way: it keeps version 0
    ops = [p.op for p in plans]
    # chunk 1 ends with its decode and its KV refresh; the new prompt is encoded before chunk 2
    assert ops.count("encode_text") == 1 and ops.index("encode_text") == ops.index("vae_decode_chunk") + 2
    assert state.prompt == "a blue cube" and state.pending_prompt is None
    assert not torch.equal(state.context, context_before)
    with pytest.raises(InvalidRequest):
        loop.update_prompt(state, "stale", 1)


def test_prompt_update_restarts_a_chunk_part_way_through_its_denoise_steps() -> None:
    """The default (``prompt_update: restart``): chunk 1, one step in when the update arrives, is generated
    again under the new prompt from fresh noise; chunk 0 is untouched and the slab is written once."""
    instance = tiny_instance()
    loop = instance.loop("realtime")
    request = make_request(CARD)
    plain, plain_plans = run_loop(instance, request)
    loop.release(plain.request_id, instance)
    state, first = run_loop(instance, request, until_chunk=1)
    state, dropped = _steps(instance, state, 1)
    state = loop.update_prompt(state, "a blue cube", 1)
    assert (state.phase, state.chunk_step, state.prompt_version) == ("text", 0, 1)
    state, rest = run_loop(instance, request, state=state)
    assert [c.prompt_version for c in state.ready] == [0, 1, 1]  # chunk 1 restarted under version 1
    ops = [p.op for p in rest]
    assert ops[0] == "encode_text" and ops[1:7] == ["causal_forward"] * 4 + ["vae_decode_chunk", "causal_forward"]
    # chunk 1 is committed once; chunk 2, the last, needs no refresh
    assert sum(bool(p.inputs["commit"]) for p in dropped + rest if p.op == "causal_forward") == 1
    a, b = generated_latents(plain_plans), generated_latents(first + dropped + rest)
    assert torch.equal(a[0], b[0]) and not torch.allclose(a[1], b[1])


def test_under_restart_a_finished_chunk_keeps_its_prompt() -> None:
    """At the chunk's KV refresh its denoise steps are done: the update waits for the next chunk."""
    instance = tiny_instance()
    loop = instance.loop("realtime")
    request = make_request(CARD)
    state, _ = run_loop(instance, request, until_chunk=1)
    state, _ = _steps(instance, state, 4)
    assert state.phase == "decode"
    state = loop.update_prompt(state, "a blue cube", 1)
    assert state.prompt_version == 0 and state.pending_version == 1
    state, _ = _steps(instance, state, 1)
    assert state.phase == "commit"
    assert state.prompt_version == 0 and state.pending_version == 1
    state, _ = run_loop(instance, request, state=state)
    assert [c.prompt_version for c in state.ready] == [0, 0, 1]


def test_prompt_update_changes_the_chunks_after_it() -> None:
    instance = tiny_instance()
    request = make_request(CARD)
    plain, plain_plans = run_loop(instance, request)
    instance.loop("realtime").release(plain.request_id, instance)
    state, first = run_loop(instance, request, until_chunk=1)
    state = instance.loop("realtime").update_prompt(state, "a blue cube", 1)
    state, rest = run_loop(instance, request, state=state)
    assert [c.prompt_version for c in state.ready] == [0, 1, 1]  # queued between chunks: the next chunk has it
    a, b = generated_latents(plain_plans), generated_latents(first + rest)
    assert torch.equal(a[0], b[0]) and not torch.allclose(a[1], b[1])


def test_suspend_and_resume_in_a_fresh_instance_is_bit_identical() -> None:
    request = make_request(CARD, frames=1 + 4 * (3 * 4 - 1))
    instance = tiny_instance(sink=1, local=2)
    straight, straight_plans = run_loop(instance, request)
    instance.loop("realtime").release(straight.request_id, instance)

    half, _ = run_loop(instance, request, until_chunk=2)
    loop = instance.loop("realtime")
    frozen = loop.suspend(half, _ctx(request))
    assert frozen.kv_snapshot is not None
    data = frozen.to_bytes()
    loop.release(half.request_id, instance)
    assert instance.block_pools()["chunk_kv"].used_slabs == 0

    fresh = tiny_instance(sink=1, local=2)  # another pool: another process's instance
    pool = fresh.block_pools()["chunk_kv"]
    pool.append(pool.open("someone-else", frozen.window.spec), 0)  # slab ids differ from the suspended ones
    resumed = fresh.loop("realtime").restore(CausalWanState.from_bytes(data), fresh, _ctx(request))
    assert resumed.kv_snapshot is None and resumed.window.positions == half.window.positions
    done, plans = run_loop(fresh, request, state=resumed)
    assert [c.chunk_index for c in done.ready] == [0, 1, 2, 3]
    for a, b in zip(straight.ready, done.ready):
        assert torch.equal(a.frames, b.frames)
    assert torch.equal(generated_latents(straight_plans)[3], generated_latents(plans)[-1])


def test_restoring_a_state_without_its_kv_is_refused() -> None:
    request = make_request(CARD)
    instance = tiny_instance()
    half, _ = run_loop(instance, request, until_chunk=1)
    fresh = tiny_instance()
    with pytest.raises(InvalidRequest, match="suspend"):
        fresh.loop("realtime").restore(CausalWanState.from_bytes(half.to_bytes()), fresh, _ctx(request))


def test_release_frees_the_session_s_slabs_and_cancel_stream_restarts_the_chunk() -> None:
    instance = tiny_instance()
    pool = instance.block_pools()["chunk_kv"]
    request = make_request(CARD)
    loop = instance.loop("realtime")
    state, _ = run_loop(instance, request, until_chunk=1)
    state = loop.advance(state, StepResult(
        outputs=instance.op("causal_forward").fn(loop.next(state).inputs, loop.next(state).params)))
    assert state.chunk_step == 1 and state.ready
    restarted = loop.cancel_stream(state)
    assert restarted.chunk_step == 0 and restarted.ready == [] and restarted.chunk_index == 1
    assert not torch.equal(restarted.latents, state.latents)
    assert pool.used_slabs == 2
    loop.release(restarted.request_id, instance)
    assert pool.used_slabs == 0


def test_an_unbounded_rollout_ends_where_the_rope_positions_run_out() -> None:
    instance = tiny_instance()  # RoPE: 32 latent frames -> 10 chunks of 3
    request = make_request(CARD).with_updates(diffusion=make_request(CARD).diffusion.model_copy(update={"frames": None}))
    loop = instance.loop("realtime")
    state, _ = run_loop(instance, request)
    assert state.max_chunks is None and state.chunk_index == 10
    done = loop.next(state)
    assert getattr(done, "reason", None) == "rope_positions_exhausted"
