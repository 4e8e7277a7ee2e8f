"""The paged text-KV pool: allocation in blocks, append/gather round trips, ownership, budgets."""

from __future__ import annotations

import pytest
import torch

from fv_kernel.api import CacheFull, KVBlockTable, PagedKVConfig, PagedKVPool
from fv_kernel.errors import CapacityError

GEOMETRY = dict(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)


def _pool(num_blocks: int = 8, width: int = 4) -> PagedKVPool:
    return PagedKVPool(PagedKVConfig(num_blocks=num_blocks, max_blocks_per_sequence=width, **GEOMETRY))


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, n, 4, generator=g), torch.randn(3, 2, n, 4, generator=g)


def test_append_then_gather_is_the_concatenation():
    pool = _pool()
    table = pool.allocate("a")
    assert table.blocks == () and pool.nbytes() == 0  # storage is lazy
    k1, v1 = _kv(6, 0)
    table = pool.append(table, k1, v1)
    assert table.length == 6 and len(table.blocks) == 2
    for step in range(3):  # token-by-token growth crosses a block boundary
        k, v = _kv(1, 10 + step)
        table = pool.append(table, k, v)
        k1, v1 = torch.cat([k1, k], dim=2), torch.cat([v1, v], dim=2)
    keys, values = pool.gather(table)
    assert torch.equal(keys, k1) and torch.equal(values, v1)
    assert len(table.blocks) == pool.blocks_for(9) == 3
    prefix_k, _ = pool.gather(table, 5)
    assert torch.equal(prefix_k, k1[:, :, :5])


def test_sequences_do_not_see_each_other_and_free_recycles_blocks():
    pool = _pool(num_blocks=4, width=4)
    a = pool.append(pool.allocate("a"), *_kv(5, 1))
    b = pool.append(pool.allocate("b"), *_kv(3, 2))
    assert set(a.blocks).isdisjoint(b.blocks)
    assert pool.used_blocks == 3 and pool.owners() == {"a": 2, "b": 1}
    assert torch.equal(pool.gather(b)[0], _kv(3, 2)[0])
    assert torch.equal(pool.gather(a)[1], _kv(5, 1)[1])
    pool.free(a)
    assert pool.free_blocks == 3
    with pytest.raises(ValueError, match="not held"):
        pool.gather(a)
    c = pool.allocate("c", tokens=12)
    assert len(c.blocks) == 3
    assert pool.free_owner("b") == 1 and pool.free_owner("c") == 3 and pool.free_blocks == 4


def test_budget_is_enforced_in_blocks():
    pool = _pool(num_blocks=3, width=3)
    pool.allocate("a", tokens=8)
    with pytest.raises(CacheFull, match="1 free of 3") as info:
        pool.allocate("b", tokens=5)
    assert isinstance(info.value, CapacityError)
    assert pool.free_blocks == 1  # a refused allocation takes nothing
    with pytest.raises(CacheFull, match="at most 3 per sequence"):
        pool.allocate("c", tokens=13)


def test_write_is_idempotent_and_rejects_holes_and_bad_shapes():
    pool = _pool()
    table = pool.append(pool.allocate("a", tokens=8), *_kv(4, 3))
    again = pool.write(table, 2, *(t[:, :, 2:] for t in _kv(4, 3)))
    assert again == table
    assert pool.used_blocks == 2
    with pytest.raises(ValueError, match="no holes"):
        pool.write(table, 6, *_kv(1, 4))
    with pytest.raises(ValueError, match="layers, kv_heads, n, head_dim"):
        pool.append(table, torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))


def test_tables_round_trip_through_plan_tensors_and_padded_gather():
    pool = _pool()
    a = pool.append(pool.allocate("a"), *_kv(5, 5))
    b = pool.append(pool.allocate("b"), *_kv(2, 6))
    rows = torch.stack([pool.table_tensor(a), pool.table_tensor(b)])
    assert rows.shape == (2, 4) and int(rows[1, 1]) == -1
    assert pool.table_from_tensor(rows[0], 5) == a
    keys, values, valid = pool.gather_padded([a, b])
    assert keys.shape == (3, 2, 2, 5, 4)
    assert valid.tolist() == [[True] * 5, [True, True, False, False, False]]
    assert torch.equal(keys[:, 1, :, :2], _kv(2, 6)[0]) and torch.count_nonzero(keys[:, 1, :, 2:]) == 0
    assert isinstance(KVBlockTable.model_validate(a.model_dump()), KVBlockTable)


def test_config_from_budget_and_validation():
    config = PagedKVConfig.from_budget(10_000, max_blocks_per_sequence=2, **GEOMETRY)
    assert config.block_bytes == 2 * 3 * 2 * 4 * 4 * 4
    assert config.num_blocks == 10_000 // config.block_bytes and config.max_blocks_per_sequence == 2
    with pytest.raises(ValueError, match="dtype"):
        PagedKVConfig(num_blocks=2, max_blocks_per_sequence=1, dtype="int8", **GEOMETRY)
    with pytest.raises(ValueError, match="max_blocks_per_sequence"):
        PagedKVConfig(num_blocks=2, max_blocks_per_sequence=3, **GEOMETRY)


# -- gather_padded: one gather for every row, zero padding, free slots for a decode step;
# -- consecutive allocation and in-place windows (what an AR decode step reads).


def _reference(pool, tables, lengths, extra):
    """Per-row gather into a zero-filled (L, B, H, T_max + extra, D) buffer: the definition."""
    c = pool.config
    t_max = max(lengths)
    keys = torch.zeros((c.num_layers, len(tables), c.num_kv_heads, t_max + extra, c.head_dim))
    values = torch.zeros_like(keys)
    for row, (table, length) in enumerate(zip(tables, lengths)):
        k, v = pool.gather(table, length)
        keys[:, row, :, :length], values[:, row, :, :length] = k, v
    return keys, values


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_padded_gather_equals_per_row_gathers_with_zero_padding(extra):
    pool = _pool(16, 6)
    pool.allocate("other", tokens=5)  # the rows' blocks do not start at 0
    a = pool.append(pool.allocate("a", tokens=16), *_kv(11, 1))
    b = pool.append(pool.allocate("b", tokens=16), *_kv(4, 2))  # exactly one block: its padding reads no block of its own
    c = pool.append(pool.allocate("c", tokens=16), *_kv(1, 3))
    # Stale data past a row's length (an earlier, longer write at the same slots) must not show through.
    c_long = pool.append(c, *_kv(6, 4))
    c = c_long.model_copy(update={"length": 1})
    pool.write(c, 0, *_kv(1, 3))
    tables, lengths = [a, b, c], [11, 4, 1]
    keys, values, valid = pool.gather_padded(tables, extra=extra)
    ref_k, ref_v = _reference(pool, tables, lengths, extra)
    assert keys.shape == ref_k.shape == (3, 3, 2, 11 + extra, 4)
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
    assert valid.tolist() == [[i < n for i in range(11)] for n in lengths]
    # lengths shorter than the tables': a prefix of each row.
    keys, _, valid = pool.gather_padded(tables, [5, 4, 1], extra=extra)
    assert torch.equal(keys, _reference(pool, tables, [5, 4, 1], extra)[0]) and valid.shape == (3, 5)


def test_the_returned_buffer_is_a_copy_a_decode_step_may_write():
    pool = _pool(16, 6)
    a = pool.append(pool.allocate("a", tokens=8), *_kv(6, 5))
    keys, values, _ = pool.gather_padded([a], extra=1)
    assert keys.stride(-1) == 1  # unit stride along head_dim, as attention kernels want
    keys[:, :, :, -1] = 7.0  # the new token's slot
    keys[:, :, :, 0] = 7.0
    assert torch.equal(pool.gather(a)[0], _kv(6, 5)[0])  # the pool is untouched


def test_one_gather_for_every_row_and_layer():
    """Counted: two index_select calls (K and V) for any number of rows, whatever their lengths."""
    pool = _pool(16, 6)
    tables = [pool.append(pool.allocate(name, tokens=12), *_kv(n, i)) for i, (name, n) in enumerate(
        [("a", 9), ("b", 3), ("c", 12)])]
    calls = []
    original = torch.Tensor.index_select

    def spy(self, *args, **kwargs):
        calls.append(self.shape)
        return original(self, *args, **kwargs)

    torch.Tensor.index_select = spy  # type: ignore[method-assign]
    try:
        pool.gather_padded(tables, extra=1)
    finally:
        torch.Tensor.index_select = original  # type: ignore[method-assign]
    assert len(calls) == 2


def test_rejects_bad_lengths_and_foreign_tables():
    pool = _pool(16, 6)
    a = pool.append(pool.allocate("a", tokens=8), *_kv(3, 6))
    with pytest.raises(ValueError, match="outside"):
        pool.gather_padded([a], [4])
    with pytest.raises(ValueError, match="lengths"):
        pool.gather_padded([a], [1, 2])
    with pytest.raises(ValueError, match="extra"):
        pool.gather_padded([a], extra=-1)
    pool.free(a)
    with pytest.raises(ValueError, match="not held"):
        pool.gather_padded([a])


def test_allocation_prefers_consecutive_blocks_and_window_views_them_in_place():
    pool = _pool(num_blocks=10, width=6)
    a = pool.allocate("a", tokens=8)  # blocks 0, 1
    b = pool.allocate("b", tokens=8)  # 2, 3
    pool.allocate("c", tokens=4)  # 4
    pool.free(a)
    pool.free(b)  # free list now [5..9] + [0, 1] + [2, 3]: the first four free ids are not a run
    d = pool.allocate("d", tokens=16)
    assert d.blocks == (0, 1, 2, 3)  # the lowest run that fits, not the head of the free list
    grown = pool.reserve(pool.allocate("e", tokens=4), 12)
    assert grown.blocks == (5, 6, 7)  # growth continues right after the table's last block
    d = pool.append(d, *_kv(13, 7))
    keys, values = pool.window(d, 14)
    assert keys.shape == (3, 1, 2, 14, 4)
    assert torch.equal(keys[:, 0, :, :13], _kv(13, 7)[0]) and torch.equal(values[:, 0, :, :13], _kv(13, 7)[1])
    keys[:, 0, :, 13] = 5.0  # writes through the view land in the pool
    assert torch.equal(pool.gather(d.model_copy(update={"length": 14}))[0][:, :, 13], torch.full((3, 2, 4), 5.0))
    assert pool.window(d, 17) is None  # past the table's blocks


def test_fragmented_pool_still_allocates_and_window_declines_scattered_blocks():
    pool = _pool(num_blocks=6, width=6)
    tables = [pool.allocate(name, tokens=4) for name in "abcdef"]
    for table in tables[::2]:
        pool.free(table)  # free ids 0, 2, 4: no run of two
    g = pool.append(pool.allocate("g", tokens=8), *_kv(8, 8))
    assert len(g.blocks) == 2 and g.blocks[1] != g.blocks[0] + 1
    assert pool.window(g, 8) is None
    assert torch.equal(pool.gather(g)[0], _kv(8, 8)[0])


def test_write_rows_equals_one_write_per_row():
    pool, one_by_one = _pool(16, 6), _pool(16, 6)
    tables, singles = [], []
    for i, n in enumerate([5, 2, 9]):
        tables.append(pool.append(pool.allocate(f"r{i}", tokens=12), *_kv(n, 20 + i)))
        singles.append(one_by_one.append(one_by_one.allocate(f"r{i}", tokens=12), *_kv(n, 20 + i)))
    g = torch.Generator().manual_seed(9)
    keys, values = torch.randn(3, 3, 2, 2, 4, generator=g), torch.randn(3, 3, 2, 2, 4, generator=g)
    written = pool.write_rows(tables, [t.length for t in tables], keys, values)
    for row, table in enumerate(singles):
        singles[row] = one_by_one.write(table, table.length, keys[:, row], values[:, row])
    assert [t.length for t in written] == [7, 4, 11]
    for a, b in zip(written, singles):
        assert all(torch.equal(x, y) for x, y in zip(pool.gather(a), one_by_one.gather(b)))
    with pytest.raises(ValueError, match="no holes"):
        pool.write_rows(written, [0, 0, 12], keys, values)
