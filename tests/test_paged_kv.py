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
