"""The slab chunk-KV pool (design §7.2): windows of sink + local chunk slabs, eviction, training mode,
snapshot/restore; its admission through the real engine and its /metrics series."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from fv_kernel.api import CacheFull, SlabKVConfig, SlabKVPool, SlabWindow, SlabWindowSpec, TrainingRollout
from fv_kernel.errors import CapacityError

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
