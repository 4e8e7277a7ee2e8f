"""What one ``ar_token`` step costs on the host, by history length and rows.

Shared by ``plugins/fv-cosmos3/tests/test_ar_token_costs.py`` (counts) and runnable as a CPU
micro-benchmark (times); figures in docs/benchmarks.md::

    python bench/bench_ar_token.py            # tiny and kvnano, 1 and 8 rows, history 32/256/512
    python bench/bench_ar_token.py --graphed  # kernels per CUDA-graphed decode step at Nano's layer structure

``kvnano`` keeps Cosmos 3 Nano's K/V geometry (36 layers x 8 KV heads x head_dim 128) with a small hidden
size, so a step's history traffic is Nano's (fp32 here) while its weights are cheap. Rows of an 8-row batch
have different lengths (history, history - 3, ...), as fused chat requests do, so the padded/masked path runs.
Times are single-threaded (``torch.set_num_threads(1)``): the benchmark machine's 2 cores are shared.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fv_kernel.api import InstanceOptions, PagedKVConfig, PagedKVPool
from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.instance import Cosmos3Instance, cosmos3_ops
from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT

CONFIGS: dict[str, Cosmos3Config] = {
    "tiny": Cosmos3Config.tiny(),
    "kvnano": Cosmos3Config.tiny(hidden_size=256, intermediate_size=512, num_hidden_layers=36, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, rope_axes_dim=(24, 20, 20), vocab_size=1024),
}

# Ops that only move or fill memory (no arithmetic): what a decode step copies besides its matmuls and attention.
_MOVES = {"index", "index_select", "cat", "copy_", "fill_", "zero_", "zeros", "zeros_like", "new_zeros", "clone",
          "_to_copy", "index_put_", "_index_put_impl_", "stack", "contiguous", "empty_like", "masked_fill",
          "masked_fill_", "gather", "index_copy", "index_copy_", "where"}
# Ops that launch no device kernel whatever their inputs: metadata, allocation without a fill, a host read.
_NO_KERNEL = {"detach", "detach_", "lift_fresh", "resolve_conj", "resolve_neg", "empty", "empty_strided", "item",
              "_local_scalar_dense"}


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _launches(func: Any, args: tuple, out: Any) -> bool:
    """Whether an op launches a device kernel: not a view or metadata op, not a ``to``/``reshape``/``contiguous``
    that handed back its input's memory (a cast to the same dtype, a viewable reshape)."""
    if func.overloadpacket.__name__ in _NO_KERNEL:
        return False
    returns = func._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        return any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs for o in outputs)
    return True


class MoveCounter(TorchDispatchMode):
    """Counts every aten op of a region, the ones among them that launch a device kernel (``launches``: what a
    CUDA graph of the region replays, one dependent kernel each), and the bytes the memory-moving ones write."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self.moved: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if _launches(func, args, out):
            self.launches[name] += 1
        if name in _MOVES:
            if name in ("index_put_", "_index_put_impl_"):
                written = _nbytes(args[2])  # the values, not the whole destination
            elif name.endswith("_"):
                written = _nbytes(args[0])
            else:
                written = sum(_nbytes(o) for o in (out if isinstance(out, (tuple, list)) else (out,)))
            self.moved[name] += written
        return out

    @property
    def bytes_moved(self) -> int:
        return sum(self.moved.values())

    @property
    def op_count(self) -> int:
        return sum(self.ops.values())

    @property
    def launch_count(self) -> int:
        return sum(self.launches.values())


def kv_bytes_per_token(config: Cosmos3Config, dtype: torch.dtype) -> int:
    """K and V of one token, every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


@dataclass
class DecodeBench:
    """A reasoner with random weights, a pool and ``rows`` sequences already holding ``history`` tokens (row r:
    ``history - 3 r``), and the plugin's own ``ar_token`` op over them."""

    config: Cosmos3Config
    mot: Cosmos3MoT
    pool: PagedKVPool
    ar_token: Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]]
    table_ids: torch.Tensor
    lengths: list[int]
    token: torch.Tensor

    @classmethod
    def build(cls, config: Cosmos3Config, rows: int, history: int, steps: int, *, seed: int = 0,
              dtype: torch.dtype = torch.float32, stride: int = 3, device: str = "cpu") -> "DecodeBench":
        gen = torch.Generator().manual_seed(seed)  # draws on the CPU, so every device gets the same weights
        mot = Cosmos3MoT(config).to(dtype).eval().requires_grad_(False)
        with torch.no_grad():
            for name, p in mot.named_parameters():
                noise = torch.randn(p.shape, generator=gen).to(dtype)
                p.copy_(noise * p[0].numel() ** -0.5 if p.dim() > 1 else (1 + 0.02 * noise if "norm" in name else 0.02 * noise))
        block = 16
        per_row = -(-(history + steps + 1) // block)
        pool = PagedKVPool(PagedKVConfig(
            num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            block_size=block, num_blocks=per_row * rows + 3, max_blocks_per_sequence=per_row,
            dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype], device=device,
        ))
        mot.to(device)
        pool.allocate("someone-else", tokens=3 * block)  # rows' blocks do not start at block 0
        lengths = [max(history - stride * r, 1) for r in range(rows)]
        tables = []
        for row, length in enumerate(lengths):
            table = pool.allocate(f"row{row}", tokens=history + steps + 1)
            shape = (config.num_hidden_layers, config.num_key_value_heads, length, config.head_dim)
            keys = torch.randn(shape, generator=gen).to(dtype)
            values = torch.randn(shape, generator=gen).to(dtype)
            tables.append(pool.write(table, 0, keys.to(device), values.to(device)))
        instance = Cosmos3Instance(card=cosmos3_card("cosmos3-tiny"), options=InstanceOptions(),
                                   component_loader=lambda component_id: None, ops_builder=cosmos3_ops,
                                   components={"transformer": mot}, text_kv_pool=pool)
        return cls(config=config, mot=mot, pool=pool, ar_token=cosmos3_ops(instance)["ar_token"].fn,
                   table_ids=torch.stack([pool.table_tensor(t) for t in tables]), lengths=lengths,
                   token=torch.randint(0, config.vocab_size, (rows, 1), generator=gen).to(device))

    def step(self) -> torch.Tensor:
        """One ``ar_token`` over every row; feeds back the greedy token and returns the logits."""
        inputs = {"token": self.token, "table": self.table_ids, "length": torch.tensor(self.lengths, dtype=torch.long)}
        with torch.inference_mode():
            logits = self.ar_token(inputs, {})["logits"]
        self.token = logits.argmax(-1, keepdim=True)
        self.lengths = [length + 1 for length in self.lengths]
        return logits


def time_steps(config: Cosmos3Config, rows: int, history: int, steps: int = 6) -> float:
    """Median ms of ``steps - 1`` ar_token steps (after one warm-up)."""
    bench = DecodeBench.build(config, rows, history, steps)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        bench.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def count_step(config: Cosmos3Config, rows: int, history: int) -> MoveCounter:
    """The ops and moved bytes of the second ar_token step (the first warms up nothing, but keep it out)."""
    bench = DecodeBench.build(config, rows, history, steps=2)
    bench.step()
    with MoveCounter() as counter:
        bench.step()
    return counter


#: Cosmos 3 Nano's layer structure (32 query / 8 KV heads of 128, SwiGLU, q/k norms, bf16 in serving) with a small
#: hidden size and vocabulary: a decode step's kernels per layer do not depend on those sizes (checked at the real ones
#: in docs/benchmarks.md), so Nano's count per step is this layer count x 36 + the fixed part.
NANO_SHAPE = Cosmos3Config.nano(hidden_size=256, intermediate_size=512, vocab_size=1024)


def count_graphed_step(config: Cosmos3Config, rows: int, *, bucket: int, dtype: torch.dtype = torch.float32,
                       sampling: bool = False, history: int = 40) -> MoveCounter:
    """The ops of one static decode step (what ``fv_cosmos3.graphed_decode`` captures in a CUDA graph and replays)
    of ``rows`` live rows in batch bucket ``bucket``, counted around the captured function alone: the host's
    filling of the static buffers is not in the graph."""
    from fv_cosmos3.graphed_decode import GraphedDecode

    bench = DecodeBench.build(config, rows, history, steps=2, dtype=dtype)
    graphed = GraphedDecode((bucket,), capture=False, min_context=64)
    inputs: dict[str, torch.Tensor] = {"token": bench.token, "table": bench.table_ids,
                                       "length": torch.tensor(bench.lengths, dtype=torch.long)}
    if sampling:
        inputs.update(temperature=torch.full((rows,), 0.7), top_k=torch.full((rows,), 20),
                      top_p=torch.full((rows,), 0.8), uniform=torch.rand(rows), penalty=torch.full((rows,), 1.5),
                      seen=torch.full((rows, 8), -1))
    with torch.inference_mode():
        assert graphed.run(bench.mot, bench.pool, "count", inputs) is not None
        (entry,) = graphed._entries.values()
        with MoveCounter() as counter:
            entry.fn(entry.static)
    return counter


def graphed_launches(config: Cosmos3Config, rows: int, *, bucket: int, dtype: torch.dtype = torch.float32,
                     sampling: bool = False) -> tuple[Counter[str], Counter[str]]:
    """Kernels of one static decode step by op, split into (per layer, fixed per step): counted at one and two
    layers of ``config``; a step of L layers launches L x per-layer + fixed."""
    counts = [count_graphed_step(Cosmos3Config(**{**config.model_dump(), "num_hidden_layers": n}), rows, bucket=bucket,
                                 dtype=dtype, sampling=sampling).launches for n in (1, 2)]
    per_layer = counts[1] - counts[0]
    return per_layer, counts[0] - per_layer


def print_graphed(layers: int = 36) -> None:
    """Kernels per static decode step at Nano's layer structure, bf16 and fp32, full and padded buckets."""
    for dtype in (torch.bfloat16, torch.float32):
        for rows, bucket, sampling in ((1, 1, False), (1, 1, True), (3, 4, False), (8, 8, True)):
            per_layer, fixed = graphed_launches(NANO_SHAPE, rows, bucket=bucket, dtype=dtype, sampling=sampling)
            total = layers * sum(per_layer.values()) + sum(fixed.values())
            print(f"{str(dtype).removeprefix('torch.'):8s} rows={rows} bucket={bucket} sampling={sampling!s:5s}: "
                  f"{sum(per_layer.values())} per layer x {layers} + {sum(fixed.values())} = {total} kernels/step  "
                  f"per layer {dict(per_layer.most_common())}  fixed {dict(fixed.most_common())}", flush=True)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    if argv == ["--graphed"]:
        print_graphed()
        return 0
    names = argv or list(CONFIGS)
    for name in names:
        config = CONFIGS[name]
        per_token = kv_bytes_per_token(config, torch.float32)
        for rows in (1, 8):
            for history in (32, 256, 512):
                ms = time_steps(config, rows, history)
                counted = count_step(config, rows, history)
                history_bytes = per_token * sum(max(history - 3 * r, 1) for r in range(rows))
                print(f"{name:7s} rows={rows} history={history:4d}: {ms:8.2f} ms/step  moved {counted.bytes_moved / 2**20:8.1f} MiB "
                      f"= {counted.bytes_moved / history_bytes:5.2f} x history K/V  ops {counted.op_count}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
