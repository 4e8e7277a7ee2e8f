"""The paged text-KV pool (design §7.2): fixed-size blocks per layer, per-request block tables.

A pool holds the K/V of many sequences in ``num_blocks`` blocks of ``block_size``
tokens; every block spans all layers, so one block id addresses
``(layer, kv_head, token-in-block, head_dim)`` for each of K and V. A sequence owns
a :class:`KVBlockTable` (its block ids in order and its token count). The table is a
small immutable value, so it lives in the request's ``LoopState`` and serialises
with it; the tensors stay in the pool.

Budgeting is in blocks. An instance exposes its pools by name
(``ModelInstance.block_pools()``); the engine registers each one with admission at
its real capacity (``num_blocks``). A loop's ``estimate`` asks for
``blocks_for(tokens)`` blocks of a named pool (``ResourceRequest.pool_blocks``), and a
request is admitted only when those blocks are free next to every admitted request's,
so the loop's allocation cannot fail: a request that does not fit waits in the queue.
The pool itself still refuses an allocation beyond ``num_blocks`` with
:class:`CacheFull` (a loop that allocates more than it estimated).

Reading K/V back for a decode step: the pool hands a sequence consecutive block ids when its
free list has such a run, and ``window`` then views that sequence's K/V in the storage itself (no
copy; the step writes its new tokens through the view). ``gather_padded`` copies any set of
sequences once, every layer, into one right-padded buffer (a batch, or blocks that are scattered).

The pool is model-agnostic: it knows layers, KV heads and head size, nothing else.
Storage is allocated on the first allocation, so building a pool costs nothing.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fv_kernel.errors import CapacityError

__all__ = ["CacheFull", "KVBlockTable", "PagedKVConfig", "PagedKVPool"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CacheFull(CapacityError):
    """The pool has fewer free blocks than an allocation needs."""


class PagedKVConfig(BaseModel):
    """Geometry and budget of one pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    block_size: int = Field(default=16, gt=0)
    num_blocks: int = Field(gt=0)
    #: Widest block table a single sequence may have (fixes the width of table tensors).
    max_blocks_per_sequence: int = Field(gt=0)
    dtype: str = "fp32"
    device: str = "cpu"

    @model_validator(mode="after")
    def _check(self) -> "PagedKVConfig":
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_blocks_per_sequence > self.num_blocks:
            raise ValueError(
                f"max_blocks_per_sequence ({self.max_blocks_per_sequence}) exceeds num_blocks ({self.num_blocks})"
            )
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V, every layer."""
        element = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * element

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.max_blocks_per_sequence * self.block_size

    @classmethod
    def from_budget(
        cls, budget_bytes: int, *, max_blocks_per_sequence: int | None = None, **geometry: object
    ) -> "PagedKVConfig":
        """As many blocks as fit in ``budget_bytes`` (at least one)."""
        probe = cls(num_blocks=1, max_blocks_per_sequence=1, **geometry)  # type: ignore[arg-type]
        blocks = max(budget_bytes // probe.block_bytes, 1)
        width = blocks if max_blocks_per_sequence is None else min(max_blocks_per_sequence, blocks)
        return cls(num_blocks=blocks, max_blocks_per_sequence=width, **geometry)  # type: ignore[arg-type]


class KVBlockTable(BaseModel):
    """One sequence's view of a pool: its block ids in order and how many tokens are written."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    owner: str
    blocks: tuple[int, ...] = ()
    length: int = Field(default=0, ge=0)

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class PagedKVPool:
    """Fixed-size KV blocks shared by every sequence on one model instance."""

    def __init__(self, config: PagedKVConfig) -> None:
        self.config = config
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._free: list[int] = list(range(config.num_blocks))
        self._owner_of: dict[int, str] = {}
        self._lock = threading.Lock()

    # -- accounting ------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.config.num_blocks - len(self._free)

    @property
    def capacity_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def capacity_bytes(self) -> int:
        """Bytes the pool's storage takes once touched (what the instance keeps on its device)."""
        return self.config.num_blocks * self.config.block_bytes

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` tokens occupies."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return -(-tokens // self.config.block_size)

    def owners(self) -> dict[str, int]:
        """Blocks held per owner."""
        counts: dict[str, int] = {}
        for owner in self._owner_of.values():
            counts[owner] = counts.get(owner, 0) + 1
        return counts

    # -- allocation ------------------------------------------------------------------
    def _storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._keys is None or self._values is None:
            c = self.config
            # Head-major, blocks inside: the blocks of several sequences gathered along dim 2 read back as
            # (layer, head, sequence, token, dim) with no further copy (``gather_padded``).
            shape = (c.num_layers, c.num_kv_heads, c.num_blocks, c.block_size, c.head_dim)
            self._keys = torch.zeros(shape, dtype=c.torch_dtype, device=c.device)
            self._values = torch.zeros(shape, dtype=c.torch_dtype, device=c.device)
        return self._keys, self._values

    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V storage itself, (num_layers, num_kv_heads, num_blocks, block_size, head_dim) each
        (allocated here on first use): for a kernel that reads and writes slots in place, e.g. a captured
        decode step, which must bind tensors that stay put. Replays are valid until the pool is rebuilt."""
        return self._storage()

    def allocate(self, owner: str, tokens: int = 0) -> KVBlockTable:
        """A new, empty table with room for ``tokens`` tokens."""
        return self.reserve(KVBlockTable(owner=owner), tokens)

    def reserve(self, table: KVBlockTable, tokens: int) -> KVBlockTable:
        """``table`` grown (if needed) so it can hold ``tokens`` tokens in total."""
        need = self.blocks_for(tokens) - len(table.blocks)
        if need <= 0:
            return table
        if self.blocks_for(tokens) > self.config.max_blocks_per_sequence:
            raise CacheFull(
                f"a sequence of {tokens} tokens needs {self.blocks_for(tokens)} blocks; at most "
                f"{self.config.max_blocks_per_sequence} per sequence ({self.config.max_tokens_per_sequence} tokens)",
                param="max_tokens",
            )
        with self._lock:
            if need > len(self._free):
                raise CacheFull(
                    f"paged KV pool: {need} block(s) wanted by {table.owner!r}, {len(self._free)} free of "
                    f"{self.config.num_blocks}",
                    param="cache_blocks",
                )
            taken = self._take(need, after=table.blocks[-1] if table.blocks else None)
            for block in taken:
                self._owner_of[block] = table.owner
        return table.model_copy(update={"blocks": table.blocks + tuple(taken)})

    def _take(self, need: int, after: int | None) -> list[int]:
        """``need`` free blocks, consecutive ids when the free list allows (under the lock).

        A sequence whose blocks are consecutive ids can be read in place (``window``) instead of
        gathered, so: the ids right after the table's last block when they are all free, else the
        lowest run of ``need`` consecutive free ids, else (a fragmented pool) the first ``need`` free.
        """
        free = set(self._free)
        run: list[int] | None = None
        if after is not None and all(after + 1 + i in free for i in range(need)):
            run = [after + 1 + i for i in range(need)]
        else:
            ordered = sorted(free)
            start = 0
            for i in range(1, len(ordered) + 1):
                if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
                    if i - start >= need:
                        run = ordered[start : start + need]
                        break
                    start = i
        if run is None:
            run = self._free[:need]
        taken = set(run)
        self._free = [b for b in self._free if b not in taken]
        return run

    def free(self, table: KVBlockTable) -> None:
        """Return ``table``'s blocks to the pool (blocks already freed are ignored)."""
        with self._lock:
            for block in table.blocks:
                if self._owner_of.get(block) == table.owner:
                    del self._owner_of[block]
                    self._free.append(block)

    def free_owner(self, owner: str) -> int:
        """Free every block ``owner`` holds (request end, cancellation, failure); returns how many."""
        with self._lock:
            mine = [b for b, o in self._owner_of.items() if o == owner]
            for block in mine:
                del self._owner_of[block]
                self._free.append(block)
        return len(mine)

    def _check_table(self, table: KVBlockTable) -> None:
        for block in table.blocks:
            if self._owner_of.get(block) != table.owner:
                raise ValueError(f"block {block} of {table.owner!r}'s table is not held by it (freed or foreign)")

    # -- data --------------------------------------------------------------------------
    def write(self, table: KVBlockTable, start: int, keys: torch.Tensor, values: torch.Tensor) -> KVBlockTable:
        """Write tokens [start, start + n) of ``table`` and return it with ``length`` covering them.

        keys/values: (num_layers, num_kv_heads, n, head_dim). Writing the same tokens
        again writes the same slots (idempotent), so a retried step is harmless. The
        table grows if it lacks room.
        """
        return self.write_rows([table], [start], keys.unsqueeze(1), values.unsqueeze(1))[0]

    def write_rows(
        self, tables: Sequence[KVBlockTable], starts: Sequence[int], keys: torch.Tensor, values: torch.Tensor
    ) -> list[KVBlockTable]:
        """``write`` for several sequences at once: tokens [starts[r], starts[r] + n) of ``tables[r]`` from
        keys/values (num_layers, B, num_kv_heads, n, head_dim), as one indexed store each for K and V."""
        c = self.config
        rows = len(tables)
        expected = (c.num_layers, rows, c.num_kv_heads, keys.shape[3] if keys.ndim == 5 else -1, c.head_dim)
        if tuple(keys.shape) != expected or keys.shape != values.shape or len(starts) != rows:
            raise ValueError(f"keys/values must be (layers, kv_heads, n, head_dim) per row = {expected}, got "
                             f"{tuple(keys.shape)} / {tuple(values.shape)} for {len(starts)} start(s)")
        n = keys.shape[3]
        out: list[KVBlockTable] = []
        blocks: list[int] = []
        offsets: list[int] = []
        for table, start in zip(tables, starts):
            if not 0 <= start <= table.length:
                raise ValueError(f"write start {start} must be within [0, {table.length}] (no holes)")
            table = self.reserve(table, start + n)
            self._check_table(table)
            for position in range(start, start + n):
                blocks.append(table.blocks[position // c.block_size])
                offsets.append(position % c.block_size)
            out.append(table.model_copy(update={"length": max(table.length, start + n)}))
        if rows == 0 or n == 0:
            return out
        store_k, store_v = self._storage()
        slots = torch.tensor([blocks, offsets], dtype=torch.long).to(c.device)  # one host-to-device copy
        # Two adjacent index tensors keep the token axis in place: storage[:, :, b, o] is (L, H, B * n, D),
        # token-major within each row, as the (L, H, B, n, D) values flatten.
        shape = (c.num_layers, c.num_kv_heads, rows * n, c.head_dim)
        store_k[:, :, slots[0], slots[1]] = keys.transpose(1, 2).reshape(shape).to(store_k.dtype)
        store_v[:, :, slots[0], slots[1]] = values.transpose(1, 2).reshape(shape).to(store_v.dtype)
        return out

    def window(self, table: KVBlockTable, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of the first ``tokens`` slots of ``table`` as (num_layers, 1, num_kv_heads, tokens, head_dim)
        views of the pool's own storage (no copy), or None when those slots' blocks are not consecutive ids
        (then ``gather_padded`` copies them) or the table lacks them. Writes through the views land in the pool;
        slots past ``table.length`` hold whatever was there (a decode step writes them before reading)."""
        c = self.config
        used = self.blocks_for(tokens)
        if tokens <= 0 or used > len(table.blocks):
            return None
        first = table.blocks[0]
        if any(table.blocks[i] != first + i for i in range(used)):
            return None
        self._check_table(table)
        store_k, store_v = self._storage()

        def view(store: torch.Tensor) -> torch.Tensor:
            # (L, H, used, bs, D) -> (L, H, used * bs, D): the blocks are adjacent, so the token axes merge.
            run = store[:, :, first : first + used].view(c.num_layers, c.num_kv_heads, used * c.block_size, c.head_dim)
            return run[:, :, :tokens].unsqueeze(1)

        return view(store_k), view(store_v)

    def append(self, table: KVBlockTable, keys: torch.Tensor, values: torch.Tensor) -> KVBlockTable:
        """Write tokens after the last written one."""
        return self.write(table, table.length, keys, values)

    def gather(self, table: KVBlockTable, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous (num_layers, num_kv_heads, length, head_dim) K and V of the first ``length`` tokens."""
        length = table.length if length is None else length
        if not 0 <= length <= table.length:
            raise ValueError(f"gather length {length} outside [0, {table.length}]")
        self._check_table(table)
        c = self.config
        if length == 0:
            empty = torch.empty((c.num_layers, c.num_kv_heads, 0, c.head_dim), dtype=c.torch_dtype, device=c.device)
            return empty, empty.clone()
        store_k, store_v = self._storage()
        used = torch.tensor(table.blocks[: self.blocks_for(length)], dtype=torch.long, device=c.device)

        def contiguous(store: torch.Tensor) -> torch.Tensor:
            # (L, H, nb, bs, D) -> (L, H, nb * bs, D), cropped to the written tokens.
            picked = store.index_select(2, used).view(c.num_layers, c.num_kv_heads, -1, c.head_dim)
            return picked[:, :, :length].contiguous()

        return contiguous(store_k), contiguous(store_v)

    def gather_padded(
        self, tables: Sequence[KVBlockTable], lengths: Sequence[int] | None = None, *, extra: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V as (num_layers, B, num_kv_heads, T_max + extra, head_dim), right-padded with zeros,
        and a boolean (B, T_max) mask of the real tokens (for batched attention).

        ``extra`` zeroed token slots follow ``T_max`` in every row: room a decode step writes its
        new tokens' K/V into, so attention reads one buffer instead of concatenating per layer.

        One gather for every row and layer: each row's blocks (padded to the widest row with its
        own first block) are read out of the pool once, straight into the returned layout; only
        the slots past each row's length are zeroed. K and V are strided views of that buffer
        (``[layer]`` is a (B, H, T, D) view with unit stride along head_dim), not contiguous tensors.
        """
        lengths = [t.length for t in tables] if lengths is None else list(lengths)
        if len(lengths) != len(tables):
            raise ValueError(f"{len(tables)} tables but {len(lengths)} lengths")
        if extra < 0:
            raise ValueError(f"extra must be >= 0, got {extra}")
        c = self.config
        rows = len(tables)
        t_max = max(lengths, default=0)
        width = t_max + extra
        valid = torch.arange(t_max, device=c.device)[None, :] < torch.tensor(lengths, dtype=torch.long, device=c.device).view(-1, 1)
        if rows == 0 or width == 0:
            empty = torch.zeros((c.num_layers, rows, c.num_kv_heads, width, c.head_dim), dtype=c.torch_dtype, device=c.device)
            return empty, empty.clone(), valid
        per_row = self.blocks_for(width)
        ids: list[int] = []
        for table, length in zip(tables, lengths):
            if not 0 <= length <= table.length:
                raise ValueError(f"gather length {length} outside [0, {table.length}]")
            self._check_table(table)
            used = list(table.blocks[: self.blocks_for(length)])
            # Slots past a row's own blocks read any block (its own first, else block 0), then are zeroed.
            ids += used + [table.blocks[0] if table.blocks else 0] * (per_row - len(used))
        index = torch.tensor(ids, dtype=torch.long, device=c.device)
        store_k, store_v = self._storage()

        def padded(store: torch.Tensor) -> torch.Tensor:
            # (L, H, B * per_row, bs, D) -> (L, H, B, per_row * bs, D) -> (L, B, H, width, D), one copy.
            picked = store.index_select(2, index).view(c.num_layers, c.num_kv_heads, rows, per_row * c.block_size, c.head_dim)
            for row, length in enumerate(lengths):
                if length < width:
                    picked[:, :, row, length:width].zero_()
            return picked.transpose(1, 2)[:, :, :, :width]

        return padded(store_k), padded(store_v), valid

    # -- tables as tensors (for WorkPlan inputs) ------------------------------------------
    def table_tensor(self, table: KVBlockTable) -> torch.Tensor:
        """(max_blocks_per_sequence,) long block ids, padded with -1, so tables of any length stack."""
        width = self.config.max_blocks_per_sequence
        if len(table.blocks) > width:
            raise ValueError(f"table has {len(table.blocks)} blocks; the pool's width is {width}")
        ids = torch.full((width,), -1, dtype=torch.long)
        ids[: len(table.blocks)] = torch.tensor(table.blocks, dtype=torch.long)
        return ids

    def table_from_tensor(self, ids: torch.Tensor, length: int) -> KVBlockTable:
        """The table a :meth:`table_tensor` row encodes; its owner is read from the pool."""
        blocks = tuple(int(b) for b in ids.reshape(-1).tolist() if b >= 0)
        if not blocks:
            raise ValueError("a block-table tensor with no blocks has no owner")
        owner = self._owner_of.get(blocks[0])
        if owner is None:
            raise ValueError(f"block {blocks[0]} is not allocated (freed table?)")
        return KVBlockTable(owner=owner, blocks=blocks, length=length)

    def owner_of(self, block: int) -> str | None:
        return self._owner_of.get(block)

    def nbytes(self) -> int:
        """Bytes the pool's storage takes (0 until the first allocation touches it)."""
        if self._keys is None or self._values is None:
            return 0
        return 2 * self._keys.numel() * self._keys.element_size()
