"""The slab chunk-KV pool (design §7.2): windows of sink + local chunk slabs, eviction, training mode,
snapshot/restore; its admission through the real engine and its /metrics series."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from fv_kernel.api import BlockPool, CacheFull, PagedKVConfig, PagedKVPool, SlabKVConfig, SlabKVPool, SlabWindow, SlabWindowSpec, TrainingRollout
from fv_kernel.errors import CapacityError

# Tiny tensors: intra-op threads only spin on a shared machine.
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

GEOMETRY = dict(num_layers=2, num_heads=2, head_dim=3, tokens_per_slab=4)


def pool(num_slabs: int = 8, **overrides: object) -> SlabKVPool:
    return SlabKVPool(SlabKVConfig(**{**GEOMETRY, "num_slabs": num_slabs, **overrides}))  # type: ignore[arg-type]


def chunk_kv(chunk: int, layer: int, tokens: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct, recognisable K/V per (chunk, layer): K = chunk * 100 + layer * 10 + token, V = -K."""
    base = chunk * 100.0 + layer * 10.0
    k = (base + torch.arange(tokens, dtype=torch.float32)).view(tokens, 1, 1).expand(tokens, 2, 3).clone()
    return k, -k


def run_chunks(p: SlabKVPool, window: SlabWindow, chunks: range) -> SlabWindow:
    for chunk in chunks:
        window, slab = p.append(window, chunk)
        for layer in range(2):
            p.write(slab, layer, *chunk_kv(chunk, layer))
    return window


def expected(chunks: list[int], layer: int) -> torch.Tensor:
    """The reference: what a window holding ``chunks`` (in attention order) reads, built without the pool."""
    return torch.cat([chunk_kv(c, layer)[0] for c in chunks]) if chunks else torch.empty(0, 2, 3)


# -- windows: append, evict sink + local, positions, read order --------------------------

def test_window_keeps_the_sinks_and_the_latest_local_chunks() -> None:
    p = pool()
    w = run_chunks(p, p.open("s", SlabWindowSpec(sink_slabs=1, local_slabs=2)), range(6))
    assert w.positions == (0, 4, 5), "sink chunk 0, then the latest two"
    assert len(w.slabs) == 3 and p.used_slabs == 3 and p.evictions == 3
    assert p.owned("s") == tuple(sorted(w.slabs))
    for layer in range(2):
        k, v = p.read(w, layer)
        assert torch.equal(k, expected([0, 4, 5], layer)) and torch.equal(v, -expected([0, 4, 5], layer))


def test_a_window_without_sinks_slides_and_positions_are_absolute() -> None:
    p = pool()
    w = run_chunks(p, p.open("s", SlabWindowSpec(sink_slabs=0, local_slabs=3)), range(7))
    assert w.positions == (4, 5, 6)
    assert torch.equal(p.read(w, 1)[0], expected([4, 5, 6], 1))


def test_read_upto_excludes_the_current_and_later_chunks() -> None:
    p = pool()
    w = run_chunks(p, p.open("s", SlabWindowSpec(sink_slabs=1, local_slabs=3)), range(5))
    assert w.positions == (0, 2, 3, 4)
    assert torch.equal(p.read(w, 0, upto=4)[0], expected([0, 2, 3], 0))
    assert torch.equal(p.read(w, 0, upto=1)[0], expected([0], 0))
    assert p.read(w, 0, upto=0)[0].shape == (0, 2, 3)


def test_a_short_chunk_reads_back_only_its_tokens() -> None:
    p = pool()
    w, first = p.append(p.open("s", SlabWindowSpec(local_slabs=2)), 0)
    p.write(first, 0, *chunk_kv(0, 0, tokens=2))
    w, second = p.append(w, 1)
    p.write(second, 0, *chunk_kv(1, 0))
    k, _ = p.read(w, 0)
    assert torch.equal(k, torch.cat([chunk_kv(0, 0, tokens=2)[0], chunk_kv(1, 0)[0]]))
    p.write(first, 0, *chunk_kv(5, 0))  # a KV refresh re-commits the chunk: the slab holds the new K/V
    assert torch.equal(p.read(w, 0)[0], torch.cat([chunk_kv(5, 0)[0], chunk_kv(1, 0)[0]]))


@pytest.mark.parametrize("short_first", [False, True])
def test_read_with_room_holds_the_history_then_unwritten_rows(short_first: bool) -> None:
    """``room`` (API 2.9): the same history, then rows for the caller's own K/V, written there, read as one."""
    p = pool()
    w, first = p.append(p.open("s", SlabWindowSpec(local_slabs=3)), 0)
    p.write(first, 1, *chunk_kv(0, 1, tokens=2 if short_first else 4))
    w, second = p.append(w, 1)
    p.write(second, 1, *chunk_kv(1, 1))
    w, _ = p.append(w, 2)  # the chunk being generated: not part of its own history
    plain_k, plain_v = p.read(w, 1, upto=2)
    k, v = p.read(w, 1, upto=2, room=4)
    tokens = plain_k.shape[0]
    assert tokens == (6 if short_first else 8) and k.shape == v.shape == (tokens + 4, 2, 3)
    assert torch.equal(k[:tokens], plain_k) and torch.equal(v[:tokens], plain_v)
    own_k, own_v = chunk_kv(2, 1)
    k[tokens:], v[tokens:] = own_k, own_v
    assert torch.equal(k, torch.cat([plain_k, own_k])) and torch.equal(v, torch.cat([plain_v, own_v]))
    assert torch.equal(p.read(w, 1, upto=2)[0], plain_k)  # a copy: writing the room leaves the pool alone
    assert p.read(w, 1, upto=0, room=4)[0].shape == (4, 2, 3)  # no history: the room alone
    with pytest.raises(ValueError, match="room must be >= 0"):
        p.read(w, 1, room=-1)


def test_in_place_views_write_into_the_pool() -> None:
    p = pool()
    w, slab = p.append(p.open("s", SlabWindowSpec(local_slabs=1)), 0)
    p.keys(slab)[1].fill_(7.0)
    p.values(slab)[1].fill_(-7.0)
    p.set_length(slab, 4)
    k, v = p.read(w, 1)
    assert bool((k == 7).all()) and bool((v == -7).all()) and k.shape == (4, 2, 3)


def test_sessions_do_not_see_each_other_and_close_recycles() -> None:
    p = pool(num_slabs=4)
    a = run_chunks(p, p.open("a", SlabWindowSpec(local_slabs=2)), range(3))
    b = run_chunks(p, p.open("b", SlabWindowSpec(local_slabs=2)), range(10, 12))
    assert torch.equal(p.read(a, 0)[0], expected([1, 2], 0))
    assert torch.equal(p.read(b, 0)[0], expected([10, 11], 0))
    p.close(a)
    assert p.free_slabs == 2 and p.owned("a") == ()
    with pytest.raises(ValueError, match="not held by it"):
        p.read(a, 0)
    assert p.close_owner("b") == 2 and p.free_slabs == 4


def test_cache_full_names_the_pool_and_changes_nothing() -> None:
    p = SlabKVPool(SlabKVConfig(**GEOMETRY, num_slabs=2), name="chunk_kv")  # type: ignore[arg-type]
    w = run_chunks(p, p.open("a", SlabWindowSpec(local_slabs=3)), range(2))
    with pytest.raises(CacheFull, match=r"slab chunk-KV pool 'chunk_kv': 1 slab\(s\) wanted by 'a', 0 free of 2") as err:
        p.append(w, 2)
    assert isinstance(err.value, CapacityError) and err.value.param == "chunk_kv"
    assert p.used_slabs == 2 and p.evictions == 0 and torch.equal(p.read(w, 0)[0], expected([0, 1], 0))


def test_a_full_window_evicts_before_it_allocates_so_a_pool_of_one_window_streams_forever() -> None:
    p = pool(num_slabs=3)
    w = run_chunks(p, p.open("a", SlabWindowSpec(sink_slabs=1, local_slabs=2)), range(20))
    assert w.positions == (0, 18, 19) and p.evictions == 17 and p.free_slabs == 0


def test_bad_input_is_refused_with_the_field_named() -> None:
    p = pool()
    w, slab = p.append(p.open("s", SlabWindowSpec(local_slabs=2)), 3)
    with pytest.raises(ValueError, match="chunk_index must exceed the window's last position 3"):
        p.append(w, 3)
    with pytest.raises(ValueError, match=r"k/v must be \[tokens <= 4, 2, 3\]"):
        p.write(slab, 0, torch.zeros(5, 2, 3), torch.zeros(5, 2, 3))
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\)"):
        p.write(slab, 2, *chunk_kv(0, 0))
    with pytest.raises(ValueError, match="slab 7 is not allocated"):
        p.write(7, 0, *chunk_kv(0, 0))
    with pytest.raises(ValueError, match="local_slabs"):
        SlabWindowSpec(sink_slabs=1, local_slabs=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        SlabKVConfig(**GEOMETRY, num_slabs=1, dtype="int8")  # type: ignore[arg-type]


def test_config_bytes_and_budget() -> None:
    c = SlabKVConfig(**GEOMETRY, num_slabs=5, dtype="bf16")  # type: ignore[arg-type]
    assert c.slab_bytes == 2 * 2 * 4 * 2 * 3 * 2
    assert SlabKVConfig.from_budget(c.slab_bytes * 3 + 1, **GEOMETRY, dtype="bf16").num_slabs == 3
    assert SlabKVConfig.from_budget(1, **GEOMETRY).num_slabs == 1
    p = SlabKVPool(c)
    assert p.capacity_bytes == 5 * c.slab_bytes and p.nbytes() == 0, "storage is allocated on first use"
    assert p.capacity_blocks == p.capacity_slabs == 5 and p.used_blocks == 0


# -- snapshot / restore ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_snapshot_restore_is_bit_identical_in_fresh_slabs(dtype: str) -> None:
    p = pool(num_slabs=8, dtype=dtype)
    spec = SlabWindowSpec(sink_slabs=1, local_slabs=2)
    w = p.open("s", spec)
    for chunk in range(5):
        w, slab = p.append(w, chunk)
        for layer in range(2):
            k = torch.randn(4 if chunk != 4 else 3, 2, 3, generator=torch.Generator().manual_seed(chunk * 2 + layer))
            p.write(slab, layer, k, k * 0.5)
    before = [p.read(w, layer) for layer in range(2)]
    snap = p.snapshot(w)
    assert all(t.device.type == "cpu" for t in snap.values())
    other = pool(num_slabs=8, dtype=dtype)
    other.append(other.open("x", spec), 0)  # the fresh pool's slab 0 is taken: restore lands elsewhere
    back = other.restore("s", spec, snap, w.positions)
    assert back.positions == w.positions and 0 not in back.slabs
    for layer in range(2):
        k, v = other.read(back, layer)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    # The restored window keeps streaming as the original would have.
    nxt, _ = other.append(back, 5)
    assert nxt.positions == (0, 4, 5)


def test_restore_refuses_a_snapshot_of_another_geometry_and_needs_free_slabs() -> None:
    p = pool(num_slabs=3)
    spec = SlabWindowSpec(local_slabs=3)
    snap = p.snapshot(run_chunks(p, p.open("s", spec), range(3)))
    with pytest.raises(ValueError, match="snapshot does not fit pool 'chunk_kv'"):
        SlabKVPool(SlabKVConfig(**{**GEOMETRY, "head_dim": 4, "num_slabs": 3})).restore("s", spec, snap, (0, 1, 2))  # type: ignore[arg-type]
    with pytest.raises(CacheFull, match="3 slab"):
        p.restore("t", spec, snap, (0, 1, 2))
    with pytest.raises(ValueError, match="missing"):
        p.restore("t", spec, {"keys": snap["keys"]}, (0, 1, 2))


# -- training mode -------------------------------------------------------------------------

def _rollout(p: SlabKVPool, owner: str, chunks: int) -> tuple[SlabWindow, list[int], dict[int, torch.Tensor]]:
    """Append ``chunks`` chunks, recording every slab handed out and the K each chunk attended to."""
    w = p.open(owner, SlabWindowSpec(sink_slabs=1, local_slabs=1))
    handed: list[int] = []
    attended: dict[int, torch.Tensor] = {}
    for chunk in range(chunks):
        w, slab = p.append(w, chunk)
        handed.append(slab)
        p.write(slab, 0, *chunk_kv(chunk, 0))
        attended[chunk] = p.read(w, 0)[0]
    return w, handed, attended


def check_training_rollout(p: SlabKVPool) -> None:
    """What training mode promises: no slab handed out twice within the rollout, every evicted slab still
    holds the K/V its chunk wrote until the rollout exits, and the history says what each chunk saw."""
    with p.training_rollout("r") as rollout:
        w, handed, attended = _rollout(p, "r", 5)
        assert len(set(handed)) == len(handed), f"a slab was recycled mid-rollout: {handed}"
        for chunk, slab in enumerate(handed):
            assert torch.equal(p.keys(slab)[0], chunk_kv(chunk, 0)[0]), f"chunk {chunk}'s K/V was overwritten"
        history = p.attended_history("r")
        assert [h.positions for h in history] == [(0,), (0, 1), (0, 2), (0, 3), (0, 4)]
        assert [h.slab for h in history] == handed
        for h in history:  # the history's slab ids read back exactly what each chunk attended to
            assert torch.equal(torch.cat([p.keys(s)[0] for s in h.slabs]), attended[h.chunk_index])
        assert w.positions == (0, 4) and p.used_slabs == 5 and p.evictions == 3
    assert rollout.history == list(history) and p.used_slabs == 2, "evicted slabs are freed when the rollout exits"


def test_training_mode_never_recycles_a_slab_mid_rollout() -> None:
    check_training_rollout(pool(num_slabs=6))


def test_negative_control_without_training_mode_a_slab_is_recycled(monkeypatch: pytest.MonkeyPatch) -> None:
    p = pool(num_slabs=6)
    _, handed, _ = _rollout(p, "r", 5)
    assert len(set(handed)) < len(handed), "outside training mode an evicted slab is reused"

    @contextlib.contextmanager
    def no_training(self: SlabKVPool, owner: str) -> Iterator[TrainingRollout]:
        yield TrainingRollout(owner)  # training mode switched off: the check must catch it

    monkeypatch.setattr(SlabKVPool, "training_rollout", no_training)
    with pytest.raises(AssertionError, match="a slab was recycled mid-rollout"):
        check_training_rollout(pool(num_slabs=6))


def test_training_mode_beyond_capacity_is_cache_full_not_reuse() -> None:
    p = pool(num_slabs=3)
    with p.training_rollout("r"):
        w = run_chunks(p, p.open("r", SlabWindowSpec(sink_slabs=0, local_slabs=1)), range(3))
        with pytest.raises(CacheFull, match="'chunk_kv'"):
            p.append(w, 3)
        with pytest.raises(RuntimeError, match="inside a training rollout"):
            p.close_owner("r")
        p.close(w)
        assert p.used_slabs == 3, "closing inside the rollout keeps the slabs until it exits"
    assert p.used_slabs == 0
    with pytest.raises(ValueError, match="no open training rollout"):
        p.attended_history("r")


def test_training_mode_is_per_owner() -> None:
    p = pool(num_slabs=6)
    with p.training_rollout("r"):
        _, handed, _ = _rollout(p, "other", 4)
    assert len(set(handed)) < len(handed), "another owner's evictions recycle as usual"


def test_windows_round_trip_through_plan_tensors_and_storage_made_in_a_step_stays_writable() -> None:
    p = pool()
    spec = SlabWindowSpec(sink_slabs=1, local_slabs=2)
    w = p.open("s", spec)
    with torch.inference_mode():  # as the executor runs steps
        w = run_chunks(p, w, range(4))
    slabs, positions = p.window_tensors(w)
    assert slabs.tolist() == list(w.slabs) and positions.tolist() == [0, 2, 3]
    short, _ = p.append(p.open("u", spec), 7)
    assert p.window_tensors(short)[1].tolist() == [7, -1, -1], "padded to the window's width"
    assert p.window_from_tensors(*p.window_tensors(short), spec) == short
    assert p.window_from_tensors(slabs, positions, spec) == w
    back = p.restore("t", spec, p.snapshot(w), w.positions)  # in-place copies outside inference mode
    assert torch.equal(p.read(back, 0)[0], expected([0, 2, 3], 0))
    p.close(w)
    with pytest.raises(ValueError, match="not allocated"):
        p.window_from_tensors(slabs, positions, spec)


# -- admission through the real engine: thirteen sessions over a pool sized for two -------

from fv_kernel.extend.observers import Observer, StepRecord  # noqa: E402
from fv_kernel.loop.plan import ResourceRequest  # noqa: E402
from fv_kernel.model.instance import build_instance  # noqa: E402
from fv_kernel.request.request import DiffusionParams, Request, TextPart  # noqa: E402
from fv_kernel.request.types import TaskType  # noqa: E402
from fv_kernel.runtime.engine import Engine, run_concurrently, run_serially  # noqa: E402
from fv_kernel.runtime import capacity  # noqa: E402
from fv_kernel.runtime.pricing import pool_key  # noqa: E402
from fv_kernel.runtime.scheduler import SchedulerConfig  # noqa: E402
from fv_kernel.card.spec import ModelCard  # noqa: E402
from fv_kernel.testing.chunk_kit import ChunkToyInstance, ToyChunkLoop, ToyChunkState, chunk_toy_card  # noqa: E402
from fv_kernel.loop.contract import Done, LoopContext  # noqa: E402
from fv_kernel.loop.plan import StepResult  # noqa: E402

WINDOW = 3  # the toy card's window: one sink + two local chunks


def chunk_card(num_slabs: int = 6) -> ModelCard:
    """The toy chunk card as ``toy-chunk-kv``: 2x2 pixels only, eight frames (four chunks) by default."""
    return chunk_toy_card("toy-chunk-kv", pool_slabs=num_slabs, height=2, width=2, frames=8, fixed_size=True)


def session(i: int, *, frames: int = 8) -> Request:
    """One toy-chunk-kv session: four chunks of two frames (the window evicts once)."""
    return Request(request_id=f"s{i}", model="toy-chunk-kv", task=TaskType.TEXT_TO_VIDEO,
                   inputs=(TextPart(text=f"prompt {i}"),), diffusion=DiffusionParams(seed=i, frames=frames))


class Live(Observer):
    """Samples, after every executed step, how many sessions run and how many slabs are held."""

    name = "live-sessions"

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.running: list[int] = []
        self.slabs: list[int] = []

    def on_step(self, record: StepRecord) -> None:
        assert self.engine is not None
        self.running.append(self.engine.running_count())
        self.slabs.append(pool_of(self.engine).used_slabs)


def pool_of(engine: Engine) -> SlabKVPool:
    instance = engine.instances["toy-chunk-kv"]
    assert isinstance(instance, ChunkToyInstance) and instance.pool is not None
    return instance.pool


def chunk_engine(num_slabs: int = 2 * WINDOW) -> tuple[Engine, Live]:
    watch = Live()
    engine = watch.engine = Engine(SchedulerConfig(device_thread=False), observers=[watch])
    engine.add_instance(build_instance(chunk_card(num_slabs=num_slabs)))
    return engine, watch


def test_thirteen_sessions_over_a_pool_for_two_all_complete_two_at_a_time() -> None:
    engine, watch = chunk_engine()
    results = run_concurrently(engine, [session(i) for i in range(13)])
    assert [r.status for r in results] == ["completed"] * 13
    peak = max(watch.running)
    assert peak == 2 and max(watch.slabs) == 2 * WINDOW, f"at most two live at once (peak {peak}), exactly what the pool holds"
    assert engine.metrics.rejections.get("admission_pool_blocks", 0) >= 1, "the third session waited for slabs"
    pool = pool_of(engine)
    assert pool.used_slabs == 0 and pool.evictions == 13, "every window evicted its oldest local chunk once, then closed"
    assert [engine.admission.pool_blocks_in_use(key) for key in engine.admission.pools] == [0], "reservations returned"
    # Sessions never read each other's slabs: session 5 among twelve others equals session 5 alone.
    alone, _ = chunk_engine()
    solo = run_serially(alone, [session(5)])[0]
    assert torch.equal(results[5].artifacts[0].frames, solo.artifacts[0].frames)
    assert results[5].artifacts[0].frames.shape == (8, 3, 2, 2)


def realtime_sessions(engine: Engine, n: int) -> list[list[Any]]:
    """``n`` sessions opened at once through the session plane (``engine.open_session``); their events."""
    from fv_kernel.api import SessionRequest

    async def go() -> list[list[Any]]:
        async with engine.running():
            handles = [engine.open_session(SessionRequest(session_id=f"r{i}", model="toy-chunk-kv", prompt=f"p{i}",
                                                          seed=i, max_chunks=4)) for i in range(n)]

            async def events(handle: Any) -> list[Any]:
                return [event async for event in handle.events()]

            return list(await asyncio.wait_for(asyncio.gather(*(events(h) for h in handles)), 60))

    return asyncio.run(go())


def test_thirteen_realtime_sessions_over_a_pool_for_two_all_complete_two_at_a_time() -> None:
    """The same through the session plane: every session streams its four chunks."""
    engine, watch = chunk_engine()
    streams = realtime_sessions(engine, 13)
    assert [s[-1].type for s in streams] == ["session.closed"] * 13
    assert [s[-1].reason for s in streams] == ["completed"] * 13
    assert [sum(e.type == "media.chunk" for e in s) for s in streams] == [4] * 13
    assert max(watch.running) == 2 and max(watch.slabs) == 2 * WINDOW, f"peak live sessions {max(watch.running)}"
    assert pool_of(engine).used_slabs == 0 and pool_of(engine).evictions == 13


def test_negative_control_realtime_sessions_without_the_slab_reservation_fail_on_a_full_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = ToyChunkLoop.estimate
    monkeypatch.setattr(ToyChunkLoop, "estimate", lambda self, request, model: real(self, request, model).model_copy(
        update={"pool_blocks": {}}))
    engine, watch = chunk_engine()
    streams = realtime_sessions(engine, 13)
    failed = [s[-1] for s in streams if s[-1].reason == "failed"]
    assert max(watch.running) > 2 and failed
    assert all(e.error is not None and e.error.type == "capacity" and "slab chunk-KV pool" in e.error.message for e in failed)


def test_negative_control_without_the_slab_reservation_a_third_session_gets_in_and_the_pool_is_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = ToyChunkLoop.estimate

    def no_slabs(self: ToyChunkLoop, request: Request, model: object) -> ResourceRequest:
        return real(self, request, model).model_copy(update={"pool_blocks": {}})  # type: ignore[arg-type]

    monkeypatch.setattr(ToyChunkLoop, "estimate", no_slabs)
    engine, watch = chunk_engine()
    results = run_concurrently(engine, [session(i) for i in range(13)])
    failed = [r for r in results if r.status == "failed"]
    assert max(watch.running) > 2, "without the reservation more sessions are admitted than the pool holds"
    assert failed and all(r.error is not None and r.error.type == "capacity" for r in failed)
    assert any(re.search(r"slab chunk-KV pool 'chunk_kv': 1 slab\(s\) wanted by 's\d+', 0 free of 6", r.error.message)
               for r in failed if r.error is not None)


def test_a_window_larger_than_the_pool_is_refused_at_admission_not_queued_forever() -> None:
    engine, _ = chunk_engine(num_slabs=WINDOW - 1)
    result = run_serially(engine, [session(0)])[0]
    assert result.status == "failed" and result.error is not None and result.error.type == "capacity"
    key = pool_key(engine.instances["toy-chunk-kv"], "chunk_kv")
    assert f"needs 3 blocks of block pool {key!r}; the pool has 2" in result.error.message


def failing(i: int, at_chunk: int) -> Request:
    return session(i).model_copy(update={"inputs": (TextPart(text=f"prompt {i} fail@{at_chunk}"),)})


def test_a_failed_session_frees_its_slabs_so_the_pool_matches_admission() -> None:
    engine, _ = chunk_engine()
    requests = [failing(i, 2) if i % 3 == 0 else session(i) for i in range(13)]
    results = run_concurrently(engine, requests)
    assert [r.status for r in results] == ["failed" if i % 3 == 0 else "completed" for i in range(13)]
    assert pool_of(engine).used_slabs == 0, "the failed sessions' windows were freed when their requests ended"


def test_negative_control_without_the_engine_freeing_them_failed_sessions_leak_and_later_ones_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Engine, "_free_slabs", staticmethod(lambda record: None))
    engine, _ = chunk_engine()
    results = run_concurrently(engine, [failing(0, 2), failing(1, 2)] + [session(i) for i in range(2, 6)])
    assert pool_of(engine).used_slabs == 2 * WINDOW
    assert any(r.status == "failed" and r.error is not None and "slab chunk-KV pool" in r.error.message for r in results[2:])


def test_a_pool_that_is_not_a_block_pool_is_refused_by_name() -> None:
    instance = build_instance(chunk_card())
    assert isinstance(instance, ChunkToyInstance)
    instance.block_pools = lambda: {"chunk_kv": object()}  # type: ignore[method-assign]
    with pytest.raises(TypeError, match="'toy-chunk-kv''s block pool 'chunk_kv' is a object, not a BlockPool"):
        Engine(SchedulerConfig(device_thread=False)).add_instance(instance)


def test_a_cancelled_session_frees_its_slabs() -> None:
    engine, _ = chunk_engine()

    async def go() -> list[str]:
        async with engine.running():
            handles = [engine.submit(session(i, frames=40)) for i in range(3)]

            async def cancel_when_running() -> None:
                while pool_of(engine).used_slabs < 2 * WINDOW:
                    await asyncio.sleep(0.001)
                for handle in handles:
                    engine.cancel(handle.request_id)

            await cancel_when_running()
            return [(await handle.result()).status for handle in handles]

    assert asyncio.run(go()) == ["cancelled"] * 3
    assert pool_of(engine).used_slabs == 0, "cancelled while two windows were held: all freed"


def test_the_pool_counts_as_the_instances_resident_memory_and_both_pools_are_block_pools() -> None:
    instance = build_instance(chunk_card(num_slabs=5))
    assert isinstance(instance, ChunkToyInstance) and instance.pool is not None
    assert capacity.instance_resident_bytes(instance) == instance.pool.capacity_bytes == 5 * instance.pool.config.slab_bytes
    paged = PagedKVPool(PagedKVConfig(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=2, max_blocks_per_sequence=2))
    assert isinstance(instance.pool, BlockPool) and isinstance(paged, BlockPool) and not isinstance(object(), BlockPool)


def test_the_docs_example_runs() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "realtime.md").read_text()
    section = text[text.index("## The slab chunk-KV pool"):]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the pool's section has a Python example"
    exec(compile(blocks[0], "docs/realtime.md", "exec"), {})  # noqa: S102 - our own doc's example


def _run(instance: ChunkToyInstance, state: ToyChunkState, *, steps: int | None = None) -> ToyChunkState:
    """Drive the toy loop's plans through the instance's ops directly (as the executor would), ``steps`` of them."""
    loop = instance.loop("rollout")
    while (steps is None or steps > 0) and not isinstance(plan := loop.next(state), Done):
        with torch.inference_mode():
            outputs = instance.op(plan.op).fn(plan.inputs, plan.params)
        state = loop.advance(state, StepResult(outputs=outputs))
        steps = None if steps is None else steps - 1
    return state


def _fresh(request: Request) -> tuple[ChunkToyInstance, ToyChunkLoop, ToyChunkState, LoopContext]:
    instance = build_instance(chunk_card())
    assert isinstance(instance, ChunkToyInstance)
    instance.load_for_task(request.task)
    loop = instance.loop("rollout")
    assert isinstance(loop, ToyChunkLoop)
    ctx = LoopContext(request=request, executor=None)  # type: ignore[arg-type]  # steps run directly in _run
    return instance, loop, loop.init(request, instance, ctx), ctx


def test_suspend_and_restore_in_another_pool_continue_bit_identically() -> None:
    """The loop's suspend copies the window's K/V into the state and frees its slabs; the state's bytes,
    restored on a fresh instance (other slab ids), finish the rollout exactly as an uninterrupted one."""
    request = session(3)
    instance, _, state, _ = _fresh(request)
    whole = _run(instance, state)
    instance, loop, state, ctx = _fresh(request)
    state = loop.suspend(_run(instance, state, steps=7), ctx)  # part-way through the second chunk
    assert state.kv is not None and instance.pool is not None and instance.pool.used_slabs == 0
    blob = state.to_bytes()
    other, other_loop, _, _ = _fresh(session(99))  # holds a slab of its own: restore lands on other ids
    back = other_loop.restore(ToyChunkState.from_bytes(blob), other, ctx)
    assert back.kv is None and back.window.positions == state.window.positions and back.window.slabs != state.window.slabs
    done = _run(other, back)
    assert torch.equal(torch.cat([c.frames for c in done.ready]), torch.cat([c.frames for c in whole.ready]))
    # Negative control: resuming on slabs whose contents were not restored gives other frames.
    instance, loop, state, ctx = _fresh(request)
    state = loop.suspend(_run(instance, state, steps=7), ctx)
    blank, blank_loop, _, _ = _fresh(session(98))
    assert blank.pool is not None
    empty = {k: torch.zeros_like(v) for k, v in (state.kv or {}).items() if k != "lengths"} | {"lengths": (state.kv or {})["lengths"]}
    wrong = _run(blank, blank_loop.restore(state.model_copy(update={"kv": empty}), blank, ctx))
    assert not torch.equal(torch.cat([c.frames for c in wrong.ready]), torch.cat([c.frames for c in whole.ready]))


# -- /metrics --------------------------------------------------------------------------------

def test_chunk_kv_series_are_in_the_prometheus_text(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from fv_kernel.config import DeployConfig
    from fv_kernel.serving import create_app

    engine, _ = chunk_engine()
    assert [r.status for r in run_concurrently(engine, [session(i) for i in range(3)])] == ["completed"] * 3
    pool = pool_of(engine)
    window, _ = pool.append(pool.open("held", SlabWindowSpec(local_slabs=2)), 0)  # one slab in use at scrape time
    with TestClient(create_app(engine, DeployConfig(output_dir=tmp_path / "out"))) as client:
        text = client.get("/metrics").text
        open_metrics = client.get("/metrics", headers={"Accept": "application/openmetrics-text"}).text
    labels = f'{{model="toy-chunk-kv",pool="{pool_key(engine.instances["toy-chunk-kv"], "chunk_kv")}"}}'
    slab_bytes = pool.config.slab_bytes
    for needle in (
        f"fv_chunk_kv_slabs_total{labels} 6.0", f"fv_chunk_kv_slabs_used{labels} 1.0",
        f"fv_chunk_kv_slabs_reserved{labels} 0.0", f"fv_chunk_kv_evictions_total{labels} 3.0",
        f"fv_chunk_kv_capacity_bytes{labels} {float(6 * slab_bytes)}", f"fv_chunk_kv_used_bytes{labels} {float(slab_bytes)}",
    ):
        assert needle in text, needle
    assert f"fv_chunk_kv_evictions_total{labels} 3" in open_metrics


def test_toy_chunk_refuses_a_size_it_cannot_generate_by_name() -> None:
    engine, _ = chunk_engine()
    bad = session(0).model_copy(update={"diffusion": DiffusionParams(seed=0, height=4)})
    result = run_serially(engine, [bad])[0]
    assert result.status == "failed" and result.error is not None
    assert result.error.type == "invalid_request" and result.error.param == "height" and "allowed: 2" in result.error.message
    assert pool_of(engine).used_slabs == 0
