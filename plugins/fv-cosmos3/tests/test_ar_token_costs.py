"""``ar_token`` no longer copies the history every step, and its tokens are the previous implementation's.

Before, every decode step copied each row's whole history about five times (an index out of the
pool, a contiguous permute, a zero-filled padded buffer, a copy into it, and a per-layer
``torch.cat`` with the new token): at 512 tokens of Cosmos 3 Nano's K/V geometry that was 727 MiB
per step for one row (fp32). Now one sequence on consecutive blocks (what the pool allocates when it
can) is attended in the pool's storage, the new K/V written straight into its slots; a batch (or a
row on scattered blocks) is gathered once, every row and layer, into a buffer with a free slot per
new token that the tower writes and attends over in place.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from bench_ar_token import CONFIGS, DecodeBench, MoveCounter, count_step, kv_bytes_per_token  # noqa: E402

from fv_cosmos3.instance import _text_kv_tensors
from fv_cosmos3.models import TextKV


def _legacy_step(bench: DecodeBench) -> torch.Tensor:
    """The step as it was before (per-row gather into zeros, concatenation in the tower): the reference."""
    pool, rows = bench.pool, len(bench.lengths)
    tables = [pool.table_from_tensor(bench.table_ids[row], bench.lengths[row]) for row in range(rows)]
    c = pool.config
    t_max = max(bench.lengths)
    keys = torch.zeros((c.num_layers, rows, c.num_kv_heads, t_max, c.head_dim), dtype=c.torch_dtype)
    values = torch.zeros_like(keys)
    valid = torch.zeros((rows, t_max), dtype=torch.bool)
    for row, table in enumerate(tables):
        k, v = pool.gather(table)
        keys[:, row, :, : table.length], values[:, row, :, : table.length] = k, v
        valid[row, : table.length] = True
    ragged = len(set(bench.lengths)) > 1
    past = TextKV(tuple(keys.unbind(0)), tuple(values.unbind(0)), "reasoner")
    positions = torch.tensor(bench.lengths).view(-1, 1)
    with torch.inference_mode():
        logits, new_kv = bench.mot.text_extend(bench.token, past, positions, past_valid=valid if ragged else None)
    new_keys, new_values = _text_kv_tensors(new_kv)
    for row, table in enumerate(tables):
        pool.write(table, table.length, new_keys[row], new_values[row])
    logits = logits[:, -1].float()
    bench.token = logits.argmax(-1, keepdim=True)
    bench.lengths = [length + 1 for length in bench.lengths]
    return logits


@pytest.mark.parametrize("rows", [1, 4])
def test_decode_is_bit_identical_to_the_copying_step(rows):
    """Same logits, same greedy tokens, same K/V written to the pool as the previous implementation,
    for one row and for a ragged batch (rows of different lengths: the masked path)."""
    config = CONFIGS["tiny"]
    new = DecodeBench.build(config, rows, history=37, steps=20, seed=3)
    old = DecodeBench.build(config, rows, history=37, steps=20, seed=3)
    tokens_new, tokens_old = [], []
    for _ in range(20):  # crosses block boundaries (block size 16)
        logits_new, logits_old = new.step(), _legacy_step(old)
        assert torch.equal(logits_new, logits_old)
        tokens_new.append(new.token.flatten().tolist())
        tokens_old.append(old.token.flatten().tolist())
    assert tokens_new == tokens_old
    for row in range(rows):
        table_new = new.pool.table_from_tensor(new.table_ids[row], new.lengths[row])
        table_old = old.pool.table_from_tensor(old.table_ids[row], old.lengths[row])
        for a, b in zip(new.pool.gather(table_new), old.pool.gather(table_old)):
            assert torch.equal(a, b)


def test_one_sequence_decodes_in_place_and_copies_nothing_that_grows_with_its_history():
    """Counted, not timed: one row on consecutive blocks (what the pool allocates when it can) is attended
    in the pool's own storage; at history 32 and 512 a step runs the same ops and moves the same bytes
    (the new token's K/V and the logits), no gather at all."""
    config = CONFIGS["tiny"]
    short, long = count_step(config, 1, 32), count_step(config, 1, 512)
    assert short.op_count == long.op_count and short.ops == long.ops
    assert short.bytes_moved == long.bytes_moved, (dict(short.moved), dict(long.moved))
    assert "index_select" not in long.ops and "index" not in long.ops
    # Less than one token's worth of K/V per layer beyond the new token itself.
    assert long.bytes_moved < 4 * kv_bytes_per_token(config, torch.float32)


def test_a_batch_copies_the_history_once_and_its_op_count_does_not_grow_with_it():
    """Counted: 8 ragged rows gather once (one index_select each for K and V, every row and layer), so the
    ops of a step are the same number at history 32 and 512 and the bytes moved grow by one copy of the
    (padded) history, not five."""
    config = CONFIGS["tiny"]
    rows = 8
    short, long = count_step(config, rows, 32), count_step(config, rows, 512)
    assert short.op_count == long.op_count, (short.ops - long.ops) + (long.ops - short.ops)
    assert long.ops["index_select"] == 2 and long.ops["index_put_"] == 2  # one gather, one write, K and V
    growth = rows * (512 - 32) * kv_bytes_per_token(config, torch.float32)
    moved = long.bytes_moved - short.bytes_moved
    assert moved <= 1.1 * growth, f"{moved / growth:.2f}x the history growth moved per step ({dict(long.moved)})"


def test_a_row_on_scattered_blocks_is_gathered_and_decodes_the_same():
    """A fragmented pool hands out non-consecutive blocks: the step falls back to the gather, same tokens."""
    config = CONFIGS["tiny"]
    new = DecodeBench.build(config, 1, history=20, steps=12, seed=5)
    old = DecodeBench.build(config, 1, history=20, steps=12, seed=5)
    for bench in (new, old):  # the same K/V, moved to blocks in reverse order
        table = bench.pool.table_from_tensor(bench.table_ids[0], bench.lengths[0])
        keys, values = bench.pool.gather(table)
        scattered = table.model_copy(update={"blocks": tuple(reversed(table.blocks))})
        bench.pool.write(scattered, 0, keys, values)
        bench.table_ids = bench.pool.table_tensor(scattered).unsqueeze(0)
    assert new.pool.window(new.pool.table_from_tensor(new.table_ids[0], 21), 21) is None
    for _ in range(12):
        assert torch.equal(new.step(), _legacy_step(old))


def test_counter_sees_the_copies_of_the_previous_step():
    """The counter is not blind: the previous implementation's step measures about five history copies."""
    config = CONFIGS["tiny"]
    moved = {}
    for history in (32, 512):
        bench = DecodeBench.build(config, 1, history, steps=2)
        _legacy_step(bench)
        with MoveCounter() as counter:
            _legacy_step(bench)
        moved[history] = counter.bytes_moved
    growth = (512 - 32) * kv_bytes_per_token(config, torch.float32)
    assert (moved[512] - moved[32]) >= 4.5 * growth
