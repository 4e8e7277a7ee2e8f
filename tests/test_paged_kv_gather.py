"""PagedKVPool.gather_padded: one gather for every row, zero padding, free slots for a decode step."""

from __future__ import annotations

import pytest
import torch

from fv_kernel.api import PagedKVConfig, PagedKVPool

GEOMETRY = dict(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)


def _pool(num_blocks: int = 16, width: int = 6) -> PagedKVPool:
    return PagedKVPool(PagedKVConfig(num_blocks=num_blocks, max_blocks_per_sequence=width, **GEOMETRY))


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, n, 4, generator=g), torch.randn(3, 2, n, 4, generator=g)


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
    pool = _pool()
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
    pool = _pool()
    a = pool.append(pool.allocate("a", tokens=8), *_kv(6, 5))
    keys, values, _ = pool.gather_padded([a], extra=1)
    assert keys.stride(-1) == 1  # unit stride along head_dim, as attention kernels want
    keys[:, :, :, -1] = 7.0  # the new token's slot
    keys[:, :, :, 0] = 7.0
    assert torch.equal(pool.gather(a)[0], _kv(6, 5)[0])  # the pool is untouched


def test_one_gather_for_every_row_and_layer():
    """Counted: two index_select calls (K and V) for any number of rows, whatever their lengths."""
    pool = _pool()
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
    pool = _pool()
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
