"""Batching live sessions: chunks of several causal Wan streams run as one ``causal_forward``.

Rows differ in timestep, prompt, RoPE offset and window (length and content); the batched op must give
each row what the row gives alone (``causal_chunk_forward``, the unbatched forward, over the same pool
history), write each committing row's K/V into its own slab, and through the Engine the scheduler must
actually fuse sessions' forwards while every stream equals its solo run. Negative controls put the
obvious batching bugs in (one row's timestep, window or slab used for every row) and see the checks fail.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from fv_kernel.api import Engine, Observer, SchedulerConfig, SessionRequest, StepRecord, StepResult
from fv_wan import causal as causal_module
from fv_wan.models import causal_transformer

from test_causal_parity import SIZE, tiny_causal_card, tiny_instance

TOL = 1e-5
FPC = 3  # latent frames per chunk on the tiny card
LATENT = (16, FPC, SIZE // 8, SIZE // 8)


def _commit_history(pool: Any, owner: str, spec: Any, chunks: int, gen: torch.Generator) -> Any:
    """A window that has committed ``chunks`` chunks of random K/V (then appended the next chunk's slab)."""
    c = pool.config
    window = pool.open(owner, spec)
    for n in range(chunks + 1):
        window, slab = pool.append(window, n)
        if n < chunks:
            for layer in range(c.num_layers):
                pool.write(slab, layer, torch.randn((c.tokens_per_slab, c.num_heads, c.head_dim), generator=gen),
                           torch.randn((c.tokens_per_slab, c.num_heads, c.head_dim), generator=gen))
    return window


def _rows(instance: Any, chunk_indices: list[int], timesteps: list[float], commits: list[bool]) -> list[dict[str, Any]]:
    """One plan-like row per session: its own window (``chunk_indices[i]`` committed chunks), latents, prompt."""
    pool = instance.block_pools()["chunk_kv"]
    spec = causal_module.CausalRecipe(max_height=SIZE, max_width=SIZE, sink_chunks=1, local_chunks=3).window
    gen = torch.Generator().manual_seed(5)
    text_dim = instance.component("transformer").config.text_dim
    rows = []
    for index, (chunk, t, commit) in enumerate(zip(chunk_indices, timesteps, commits)):
        window = _commit_history(pool, f"s{index}", spec, chunk, gen)
        slabs, positions = pool.window_tensors(window)
        rows.append({"window": window, "inputs": {
            "latents": torch.randn((1, *LATENT), generator=gen), "timestep": torch.tensor([t]),
            "context": torch.randn((1, 16, text_dim), generator=gen), "window_slabs": slabs[None],
            "window_positions": positions[None], "chunk_index": torch.tensor([chunk]),
            "start_frame": torch.tensor([chunk * FPC]), "commit": torch.tensor([commit])}})
    return rows


def _batched_vs_alone(instance: Any, rows: list[dict[str, Any]]) -> float:
    """Worst difference between the batched op and each row alone: flows, and each committed slab's K/V."""
    pool = instance.block_pools()["chunk_kv"]
    model = instance.component("transformer")
    want_flow, want_kv = [], []
    for row in rows:
        x = row["inputs"]
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            want_flow.append(causal_transformer.causal_chunk_forward(
                model, x["latents"], x["timestep"], x["context"], start_frame=int(x["start_frame"]),
                history=causal_module._PoolHistory(pool, row["window"], int(x["chunk_index"])),
                kv_sink=lambda layer, k, v, kv=kv: kv.__setitem__(layer, (k[0].clone(), v[0].clone()))))
        want_kv.append(kv)
    before = [pool.read(row["window"], 0) for row in rows]
    op = instance.op("causal_forward")
    got = op.run_fused([row["inputs"] for row in rows], {"sink_slabs": 1, "local_slabs": 3})
    worst = max(float((g["flow"] - w).abs().max()) for g, w in zip(got, want_flow))
    tokens = pool.config.tokens_per_slab
    for row, kv, old in zip(rows, want_kv, before):
        for layer in range(pool.config.num_layers):
            k, v = pool.read(row["window"], layer)
            if bool(row["inputs"]["commit"]):  # its own slab (the window's last) holds its own K/V
                worst = max(worst, float((k[-tokens:] - kv[layer][0]).abs().max()),
                            float((v[-tokens:] - kv[layer][1]).abs().max()))
            elif layer == 0:  # a non-committing row's window is untouched
                worst = max(worst, float((k - old[0]).abs().max()), float((v - old[1]).abs().max()))
    return worst


CASES = {
    # rows: (chunk index = committed chunks before it, timestep, commit)
    "two": ([4, 0], [937.5, 1000.0], [False, True]),
    "three": ([3, 1, 0], [833.3, 0.0, 1000.0], [False, True, True]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_forward_equals_each_row_alone(case: str) -> None:
    chunks, timesteps, commits = CASES[case]
    instance = tiny_instance(sink=1, local=3, sessions=len(chunks))
    rows = _rows(instance, chunks, timesteps, commits)
    lengths = {len(row["window"].slabs) for row in rows}
    assert len(lengths) == len(rows)  # every row has its own window fill (the first chunk: no history)
    assert _batched_vs_alone(instance, rows) <= TOL


def _bugged(bug: str) -> Any:
    real = causal_transformer.causal_batch_forward

    def forward(model: Any, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, *,
                start_frames: Any, histories: Any, kv_sinks: Any = None, **kw: Any) -> torch.Tensor:
        rows = latents.shape[0]
        if bug == "timestep":
            timestep = timestep[:1].expand(rows)
        elif bug == "window":
            histories = [histories[0]] * rows
        elif bug == "slab":
            kv_sinks = list(reversed(kv_sinks))
        return real(model, latents, timestep, context, start_frames=start_frames, histories=histories,
                    kv_sinks=kv_sinks, **kw)

    return forward


@pytest.mark.parametrize("bug", ["timestep", "window", "slab"])
def test_negative_controls_fail_the_comparison(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 0's timestep / KV window for every row, or a commit into the other row's slab: the check fails."""
    chunks, timesteps, commits = CASES["two"]
    instance = tiny_instance(sink=1, local=3, sessions=2)
    monkeypatch.setattr(causal_module, "causal_batch_forward", _bugged(bug))
    assert _batched_vs_alone(instance, _rows(instance, chunks, timesteps, commits)) > 1e-3


def test_plans_of_different_sessions_share_a_batch_key() -> None:
    """Sessions at different chunks, steps, prompts and window fills plan forwards that batch together."""
    from test_causal_parity import make_request, run_loop

    instance = tiny_instance(sink=1, local=3, sessions=2)
    loop = instance.loop("realtime")
    a, _ = run_loop(instance, make_request("wan-tiny-causal", prompt="a red ball", seed=1), until_chunk=2)
    b, _ = run_loop(instance, make_request("wan-tiny-causal", prompt="a blue cube", seed=2), until_chunk=0)
    plan_b = loop.next(b)
    while plan_b.op != "causal_forward":  # b's text encode first
        b = loop.advance(b, StepResult(outputs=instance.op(plan_b.op).fn(plan_b.inputs, plan_b.params)))
        plan_b = loop.next(b)
    plan_a = loop.next(a)
    assert plan_a.op == plan_b.op == "causal_forward" and plan_a.batchable and plan_b.batchable
    assert a.window.slabs != b.window.slabs and a.chunk_index != b.chunk_index
    assert plan_a.batch_key() == plan_b.batch_key()


# --------------------------------------------------------------------------- through the Engine


class _Batches(Observer):
    name = "batches"

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

        self.decodes: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        if record.op == "causal_forward":
            self.records.append(record)
        elif record.op == "vae_decode_chunk":
            self.decodes.append(record)


SESSIONS = [("a", "a red ball rolls", 1, 0.0), ("b", "a blue cube spins", 2, 1.0), ("c", "green rain", 3, 2.0)]
CHUNKS = 3


def _engine_instance(sessions: int) -> Any:
    """The tiny causal card with the recipe's own defaults (4 steps, no CFG) so a session runs as-is."""
    from fv_kernel.api import InstanceOptions, TaskType, build_instance

    card = tiny_causal_card(sink=1, local=3, sessions=sessions)
    defaults = card.capabilities.defaults.model_copy(update={"steps": 4, "guidance": 1.0, "height": SIZE, "width": SIZE})
    card = card.model_copy(update={"capabilities": card.capabilities.model_copy(update={"defaults": defaults})})
    instance = build_instance(card, InstanceOptions(device="cpu", precision="fp32"))
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    return instance


async def _run(sessions: list[tuple[str, str, int, float]], observer: _Batches) -> dict[str, list[torch.Tensor]]:
    engine = Engine(SchedulerConfig(device_thread=False), observers=[observer])
    engine.add_instance(_engine_instance(len(sessions)))
    out: dict[str, list[torch.Tensor]] = {}
    closed: dict[str, str] = {}

    async def one(session_id: str, prompt: str, seed: int, after_chunks: float) -> None:
        # Later sessions start once others have emitted chunks: rows at different chunk indices and fills.
        while sum(len(v) for v in out.values()) < after_chunks and not closed:
            await asyncio.sleep(0.001)
        handle = engine.open_session(SessionRequest(session_id=session_id, model="wan-tiny-causal", prompt=prompt,
                                                    seed=seed, height=SIZE, width=SIZE, max_chunks=CHUNKS))
        out[session_id] = []
        async for event in handle.events():
            if event.type == "media.chunk":
                out[session_id].append(event.frames)
            elif event.type == "session.closed":
                closed[session_id] = str(event.reason)

    async with engine.running():
        await asyncio.wait_for(asyncio.gather(*(one(*s) for s in sessions)), 120)
    assert set(closed.values()) == {"completed"}, closed
    return out


def _streams_vs_solo(observer: _Batches) -> float:
    """Worst frame difference of the three staggered sessions run together vs each run alone."""
    together = asyncio.run(_run(SESSIONS, observer))
    worst = 0.0
    for session in SESSIONS:
        solo = asyncio.run(_run([session[:3] + (0.0,)], _Batches()))[session[0]]
        got = together[session[0]]
        assert len(got) == len(solo) == CHUNKS
        worst = max(worst, *(float((g - s).abs().max()) for g, s in zip(got, solo)))
    return worst


def test_concurrent_sessions_batch_and_each_stream_equals_its_solo_run() -> None:
    observer = _Batches()
    assert _streams_vs_solo(observer) <= TOL
    sizes = [r.batch_size for r in observer.records]
    assert max(sizes) >= 2, sizes  # the scheduler really fused sessions' forwards
    assert all(all(r.fused) for r in observer.records if r.batch_size > 1)
    # Rows of sessions at different steps (so chunk indices / window fills) shared a call: the staggered start.
    assert any(len(set(r.steps)) > 1 for r in observer.records if r.batch_size > 1)
    # The chunk decode (each session's own VAE causal cache) stays batch-of-1.
    assert observer.decodes and all(r.batch_size == 1 for r in observer.decodes)


def test_engine_comparison_catches_a_row_reading_row_0_s_timestep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the engine check: with the timestep bug in, the batched streams leave their solo runs."""
    monkeypatch.setattr(causal_module, "causal_batch_forward", _bugged("timestep"))
    assert _streams_vs_solo(_Batches()) > 1e-3
