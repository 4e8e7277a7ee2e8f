"""The slab chunk-KV pool (design §7.2): one slab per generated chunk, windowed per session.

A causal video model generates chunk after chunk; each chunk attends to the K/V of a
window of earlier chunks: a few *sink* chunks (the first ones, kept for the whole
session) and the most recent *local* chunks. The pool holds ``num_slabs`` slabs; a slab
is one chunk's K/V for every layer (``tokens_per_slab`` tokens, ``num_heads`` heads of
``head_dim``). A session owns a :class:`SlabWindow`, a small immutable value (slab ids in
attention order and the chunk index each holds) that lives in its ``LoopState`` and
serialises with it; the tensors stay in the pool.

``append`` gives the window a slab for its next chunk; once the window holds
``sink_slabs + local_slabs`` slabs, the oldest non-sink slab is evicted (freed and
counted), so a session never holds more than its window: that is what admission
reserves (``ResourceRequest.pool_blocks = {"chunk_kv": spec.max_slabs}``), so a loop's
``append`` cannot fail for lack of slabs. Without the reservation it raises
:class:`CacheFull` naming the pool.

Training mode (``training_rollout``) is for self-forcing rollouts, whose loss
backpropagates through the K/V each chunk attended to: an evicted slab leaves the
window's attention set but stays allocated and is never handed to anyone until the
rollout exits, and ``attended_history`` records which slabs and positions each append
saw. Allocation beyond capacity is then ``CacheFull``, never a silent reuse.

``snapshot``/``restore`` copy a window's K/V out of and back into the pool (suspend and
resume bit-identically). The pool is model-agnostic (layers, heads, head size) and
allocates its storage on first use, so building one costs nothing.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fv_kernel.cache.paged_kv import CacheFull

__all__ = [
    "AttendedChunk", "CacheFull", "SlabKVConfig", "SlabKVPool", "SlabWindow", "SlabWindowSpec", "TrainingRollout",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SNAPSHOT_KEYS = ("keys", "values", "lengths")


class SlabKVConfig(BaseModel):
    """Geometry and budget of one slab pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    #: Tokens of one chunk (one slab holds them for every layer).
    tokens_per_slab: int = Field(gt=0)
    num_slabs: int = Field(gt=0)
    dtype: str = "fp32"
    device: str = "cpu"

    @model_validator(mode="after")
    def _check(self) -> "SlabKVConfig":
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def slab_bytes(self) -> int:
        """Bytes of one slab: K and V, every layer."""
        element = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.tokens_per_slab * self.num_heads * self.head_dim * element

    @classmethod
    def from_budget(cls, budget_bytes: int, **geometry: object) -> "SlabKVConfig":
        """As many slabs as fit in ``budget_bytes`` (at least one)."""
        probe = cls(num_slabs=1, **geometry)  # type: ignore[arg-type]
        return cls(num_slabs=max(budget_bytes // probe.slab_bytes, 1), **geometry)  # type: ignore[arg-type]


class SlabWindowSpec(BaseModel):
    """A session's attention window, in chunks: the first ``sink_slabs`` plus the latest ``local_slabs``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sink_slabs: int = Field(default=0, ge=0)
    local_slabs: int = Field(ge=1)

    @property
    def max_slabs(self) -> int:
        """Slabs a window holds at most (what admission reserves for it)."""
        return self.sink_slabs + self.local_slabs


class SlabWindow(BaseModel):
    """One session's view of the pool: its slab ids in attention order (sinks first, then local, oldest
    first) and the absolute chunk index each slab holds (for RoPE)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    owner: str
    slabs: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    spec: SlabWindowSpec

    @model_validator(mode="after")
    def _check(self) -> "SlabWindow":
        if len(self.slabs) != len(self.positions):
            raise ValueError(f"a window has one position per slab: {len(self.slabs)} slabs, {len(self.positions)} positions")
        if len(self.slabs) > self.spec.max_slabs:
            raise ValueError(f"a window holds at most {self.spec.max_slabs} slabs, got {len(self.slabs)}")
        if list(self.positions) != sorted(set(self.positions)):
            raise ValueError(f"window positions must strictly increase, got {self.positions}")
        return self


class AttendedChunk(BaseModel):
    """What one append of a training rollout saw: the window (slab ids, positions) right after it,
    i.e. the K/V the new chunk attends to, itself included."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_index: int
    slab: int
    slabs: tuple[int, ...]
    positions: tuple[int, ...]
    evicted: int | None = None


class TrainingRollout:
    """An open training rollout of one owner: its attended history and the slabs evicted but kept."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.history: list[AttendedChunk] = []
        self.retired: list[int] = []
        self.active = True


class SlabKVPool:
    """Chunk-sized KV slabs shared by every session on one model instance."""

    def __init__(self, config: SlabKVConfig, *, name: str = "chunk_kv") -> None:
        self.config = config
        self.name = name
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        # A stack: the most recently freed slab is reused first (a full window's next chunk lands in the slab it
        # just evicted, still hot in the device cache); fresh pools hand out 0, 1, 2, ...
        self._free: list[int] = list(range(config.num_slabs - 1, -1, -1))
        self._owner_of: dict[int, str] = {}
        # Tokens written per (slab, layer): a chunk may be shorter than tokens_per_slab.
        self._lengths = torch.zeros((config.num_slabs, config.num_layers), dtype=torch.long)
        self._evictions = 0
        self._rollouts: dict[str, TrainingRollout] = {}
        self._lock = threading.RLock()

    # -- accounting ------------------------------------------------------------------
    @property
    def free_slabs(self) -> int:
        return len(self._free)

    @property
    def used_slabs(self) -> int:
        return self.config.num_slabs - len(self._free)

    @property
    def capacity_slabs(self) -> int:
        return self.config.num_slabs

    @property
    def capacity_bytes(self) -> int:
        """Bytes the pool's storage takes once touched."""
        return self.config.num_slabs * self.config.slab_bytes

    @property
    def evictions(self) -> int:
        """Slabs evicted from windows since the pool was built (training-mode evictions included)."""
        return self._evictions

    # Admission counts every pool in blocks (``BlockPool``): a slab is this pool's block.
    capacity_blocks = capacity_slabs
    used_blocks = used_slabs
    free_blocks = free_slabs

    def owned(self, owner: str) -> tuple[int, ...]:
        """Slab ids ``owner`` holds (its windows' and, in a training rollout, the evicted ones kept)."""
        with self._lock:
            return tuple(sorted(s for s, o in self._owner_of.items() if o == owner))

    def slab_length(self, slab: int, layer: int = 0) -> int:
        """Tokens written into ``slab`` for ``layer``."""
        return int(self._lengths[slab, layer])

    # -- windows ---------------------------------------------------------------------
    def _storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._keys is None or self._values is None:
            c = self.config
            # Slab-major, tokens before heads: a window's slabs of one layer index-select into
            # (slabs, tokens, heads, dim), which flattens to the [tokens, heads, dim] read returns.
            shape = (c.num_slabs, c.num_layers, c.tokens_per_slab, c.num_heads, c.head_dim)
            # Steps run under inference_mode; storage made there could never be written outside it
            # (restore, a training rollout), so it is always a normal tensor.
            with torch.inference_mode(False):
                self._keys = torch.zeros(shape, dtype=c.torch_dtype, device=c.device)
                self._values = torch.zeros(shape, dtype=c.torch_dtype, device=c.device)
        return self._keys, self._values

    def open(self, owner: str, spec: SlabWindowSpec) -> SlabWindow:
        """An empty window for ``owner`` (takes no slab yet)."""
        return SlabWindow(owner=owner, spec=spec)

    def _full(self, owner: str, want: int) -> CacheFull:
        return CacheFull(
            f"slab chunk-KV pool {self.name!r}: {want} slab(s) wanted by {owner!r}, {len(self._free)} free of "
            f"{self.config.num_slabs} (reserve the window's slabs at admission: pool_blocks[{self.name!r}])",
            param=self.name,
        )

    def append(self, window: SlabWindow, chunk_index: int) -> tuple[SlabWindow, int]:
        """``window`` with a fresh slab for chunk ``chunk_index``, and that slab's id.

        A full window first evicts its oldest non-sink slab (freed, or in a training rollout kept
        allocated until the rollout exits). Nothing changes when this raises.
        """
        if window.positions and chunk_index <= window.positions[-1]:
            raise ValueError(f"chunk_index must exceed the window's last position {window.positions[-1]}, got {chunk_index}")
        if chunk_index < 0:
            raise ValueError(f"chunk_index must be >= 0, got {chunk_index}")
        with self._lock:
            self._check_window(window)
            rollout = self._rollouts.get(window.owner)
            full = len(window.slabs) >= window.spec.max_slabs
            victim = window.spec.sink_slabs if full else None
            evicted = window.slabs[victim] if victim is not None else None
            recycles = evicted is not None and rollout is None
            if not self._free and not recycles:
                raise self._full(window.owner, 1)
            slabs, positions = list(window.slabs), list(window.positions)
            if victim is not None and evicted is not None:
                del slabs[victim], positions[victim]
                self._evictions += 1
                if rollout is None:
                    self._release(evicted)
                else:
                    rollout.retired.append(evicted)
            slab = self._free.pop()
            self._owner_of[slab] = window.owner
            self._lengths[slab] = 0
            slabs.append(slab)
            positions.append(chunk_index)
            out = window.model_copy(update={"slabs": tuple(slabs), "positions": tuple(positions)})
            if rollout is not None:
                rollout.history.append(AttendedChunk(
                    chunk_index=chunk_index, slab=slab, slabs=out.slabs, positions=out.positions, evicted=evicted,
                ))
        return out, slab

    def _release(self, slab: int) -> None:
        """Back to the free list (under the lock)."""
        del self._owner_of[slab]
        self._free.append(slab)

    def close(self, window: SlabWindow) -> None:
        """Free ``window``'s slabs (in a training rollout: when the rollout exits). Slabs already freed are ignored."""
        with self._lock:
            rollout = self._rollouts.get(window.owner)
            for slab in window.slabs:
                if self._owner_of.get(slab) != window.owner:
                    continue
                if rollout is None:
                    self._release(slab)
                elif slab not in rollout.retired:
                    rollout.retired.append(slab)

    def close_owner(self, owner: str) -> int:
        """Free every slab ``owner`` holds (session end, cancellation, failure); returns how many.

        Refused inside the owner's training rollout (its slabs must outlive the rollout's backward pass).
        """
        with self._lock:
            if owner in self._rollouts:
                raise RuntimeError(f"{owner!r} is inside a training rollout; its slabs are freed when the rollout exits")
            mine = [s for s, o in self._owner_of.items() if o == owner]
            for slab in mine:
                self._release(slab)
        return len(mine)

    def _check_window(self, window: SlabWindow) -> None:
        for slab in window.slabs:
            if not 0 <= slab < self.config.num_slabs or self._owner_of.get(slab) != window.owner:
                raise ValueError(f"slab {slab} of {window.owner!r}'s window is not held by it (freed or foreign)")

    # -- data --------------------------------------------------------------------------
    def _check_slab(self, slab: int, layer: int | None = None) -> None:
        if not 0 <= slab < self.config.num_slabs or slab not in self._owner_of:
            raise ValueError(f"slab {slab} is not allocated in pool {self.name!r}")
        if layer is not None and not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer must be in [0, {self.config.num_layers}), got {layer}")

    def write(self, slab: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer of a chunk's K/V, ``[tokens, num_heads, head_dim]`` with tokens <= tokens_per_slab.

        Writing again overwrites (a KV refresh re-writes the chunk's slab with its clean K/V).
        """
        c = self.config
        if k.ndim != 3 or k.shape != v.shape or k.shape[1:] != (c.num_heads, c.head_dim) or not 0 < k.shape[0] <= c.tokens_per_slab:
            raise ValueError(
                f"k/v must be [tokens <= {c.tokens_per_slab}, {c.num_heads}, {c.head_dim}], got {tuple(k.shape)} / {tuple(v.shape)}"
            )
        self._check_slab(slab, layer)
        store_k, store_v = self._storage()
        n = k.shape[0]
        store_k[slab, layer, :n] = k.to(store_k.dtype)
        store_v[slab, layer, :n] = v.to(store_v.dtype)
        self._lengths[slab, layer] = n

    def keys(self, slab: int) -> torch.Tensor:
        """``slab``'s K as a ``[num_layers, tokens_per_slab, num_heads, head_dim]`` view of the pool (no copy).

        A write through the view does not set the slab's length: call ``set_length`` after.
        """
        self._check_slab(slab)
        return self._storage()[0][slab]

    def values(self, slab: int) -> torch.Tensor:
        """``slab``'s V, as :meth:`keys`."""
        self._check_slab(slab)
        return self._storage()[1][slab]

    def set_length(self, slab: int, tokens: int) -> None:
        """Record ``tokens`` written in every layer of ``slab`` (after in-place writes through ``keys``/``values``)."""
        self._check_slab(slab)
        if not 0 <= tokens <= self.config.tokens_per_slab:
            raise ValueError(f"tokens must be in [0, {self.config.tokens_per_slab}], got {tokens}")
        self._lengths[slab] = tokens

    def read(self, window: SlabWindow, layer: int, *, upto: int | None = None,
             room: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``window`` for ``layer``, concatenated in window order: ``[tokens, num_heads, head_dim]``.

        ``upto`` (a chunk index, exclusive) keeps only slabs holding earlier chunks (a chunk's history
        without itself). The result is a copy. ``room`` (API 2.9) adds that many rows after the window's
        tokens, left unwritten: a caller that attends over the history followed by its own K/V writes
        them there instead of concatenating (one copy of the history fewer).
        """
        c = self.config
        if room < 0:
            raise ValueError(f"room must be >= 0, got {room}")
        with self._lock:
            self._check_window(window)
            if not 0 <= layer < c.num_layers:
                raise ValueError(f"layer must be in [0, {c.num_layers}), got {layer}")
            picked = [s for s, p in zip(window.slabs, window.positions) if upto is None or p < upto]
            lengths = [int(self._lengths[s, layer]) for s in picked]
            tokens = sum(lengths)
            shape = (tokens + room, c.num_heads, c.head_dim)
            k = torch.empty(shape, dtype=c.torch_dtype, device=c.device)
            v = torch.empty(shape, dtype=c.torch_dtype, device=c.device)
            if not picked:
                return k, v
            store_k, store_v = self._storage()
            if all(n == c.tokens_per_slab for n in lengths):
                # Whole slabs: one gather each, straight into the result.
                index = torch.tensor(picked, dtype=torch.long, device=c.device)
                for store, out in ((store_k, k), (store_v, v)):
                    torch.index_select(store[:, layer], 0, index, out=out[:tokens].view(len(picked), c.tokens_per_slab,
                                                                                       c.num_heads, c.head_dim))
                return k, v
            start = 0
            for slab, n in zip(picked, lengths):
                k[start : start + n] = store_k[slab, layer, :n]
                v[start : start + n] = store_v[slab, layer, :n]
                start += n
        return k, v

    # -- windows as tensors (for WorkPlan inputs) ------------------------------------------
    def window_tensors(self, window: SlabWindow) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slabs, positions)`` as ``(spec.max_slabs,)`` long tensors padded with -1, so windows of any fill stack."""
        width = window.spec.max_slabs
        slabs = torch.full((width,), -1, dtype=torch.long)
        positions = torch.full((width,), -1, dtype=torch.long)
        slabs[: len(window.slabs)] = torch.tensor(window.slabs, dtype=torch.long)
        positions[: len(window.positions)] = torch.tensor(window.positions, dtype=torch.long)
        return slabs, positions

    def window_from_tensors(self, slabs: torch.Tensor, positions: torch.Tensor, spec: SlabWindowSpec) -> SlabWindow:
        """The window a :meth:`window_tensors` pair encodes; its owner is read from the pool."""
        ids = tuple(int(s) for s in slabs.reshape(-1).tolist() if s >= 0)
        where = tuple(int(p) for p in positions.reshape(-1).tolist() if p >= 0)
        if not ids:
            raise ValueError("a window tensor with no slabs has no owner")
        owner = self._owner_of.get(ids[0])
        if owner is None:
            raise ValueError(f"slab {ids[0]} is not allocated in pool {self.name!r} (closed window?)")
        return SlabWindow(owner=owner, slabs=ids, positions=where, spec=spec)

    def owner_of(self, slab: int) -> str | None:
        return self._owner_of.get(slab)

    # -- suspend / resume ----------------------------------------------------------------
    def snapshot(self, window: SlabWindow) -> dict[str, torch.Tensor]:
        """``window``'s K/V as CPU tensors: ``keys``/``values`` ``[slabs, layers, tokens_per_slab, heads, dim]`` and
        ``lengths`` ``[slabs, layers]``, in window order (what ``restore`` takes back)."""
        c = self.config
        with self._lock:
            self._check_window(window)
            index = torch.tensor(window.slabs, dtype=torch.long)
            if not window.slabs:
                shape = (0, c.num_layers, c.tokens_per_slab, c.num_heads, c.head_dim)
                empty = torch.zeros(shape, dtype=c.torch_dtype)
                return {"keys": empty, "values": empty.clone(), "lengths": torch.zeros((0, c.num_layers), dtype=torch.long)}
            store_k, store_v = self._storage()
            return {
                "keys": store_k.index_select(0, index.to(c.device)).cpu(),
                "values": store_v.index_select(0, index.to(c.device)).cpu(),
                "lengths": self._lengths.index_select(0, index).clone(),
            }

    def restore(
        self, owner: str, spec: SlabWindowSpec, snapshot: dict[str, torch.Tensor], positions: tuple[int, ...] | list[int]
    ) -> SlabWindow:
        """A window for ``owner`` holding ``snapshot``'s K/V at ``positions`` (fresh slabs, contents copied back)."""
        c = self.config
        missing = [k for k in _SNAPSHOT_KEYS if k not in snapshot]
        if missing:
            raise ValueError(f"a slab snapshot needs {list(_SNAPSHOT_KEYS)}; missing {missing}")
        keys, values, lengths = snapshot["keys"], snapshot["values"], snapshot["lengths"]
        n = len(positions)
        shape = (n, c.num_layers, c.tokens_per_slab, c.num_heads, c.head_dim)
        if tuple(keys.shape) != shape or tuple(values.shape) != shape or tuple(lengths.shape) != (n, c.num_layers):
            raise ValueError(
                f"snapshot does not fit pool {self.name!r}: keys/values must be {shape} and lengths {(n, c.num_layers)} "
                f"for {n} position(s), got {tuple(keys.shape)} / {tuple(values.shape)} / {tuple(lengths.shape)}"
            )
        if keys.dtype != c.torch_dtype or values.dtype != c.torch_dtype:
            raise ValueError(f"snapshot dtype {keys.dtype} differs from pool {self.name!r}'s {c.torch_dtype}")
        # Validates the positions against the spec before any slab is taken (the ids are placeholders).
        window = SlabWindow(owner=owner, spec=spec, slabs=tuple(range(n)), positions=tuple(positions))
        with self._lock:
            if n > len(self._free):
                raise self._full(owner, n)
            slabs = [self._free.pop() for _ in range(n)]
            for slab in slabs:
                self._owner_of[slab] = owner
            if n:
                store_k, store_v = self._storage()
                index = torch.tensor(slabs, dtype=torch.long)
                store_k[index.to(c.device)] = keys.to(c.device)
                store_v[index.to(c.device)] = values.to(c.device)
                self._lengths[index] = lengths.to(torch.long)
        return window.model_copy(update={"slabs": tuple(slabs)})

    # -- training mode --------------------------------------------------------------------
    @contextlib.contextmanager
    def training_rollout(self, owner: str) -> Iterator[TrainingRollout]:
        """Inside, no slab of ``owner`` is recycled: evicted and closed slabs stay allocated (not reused)
        until exit, when they are freed. The yielded rollout's ``history`` keeps what each append saw."""
        with self._lock:
            if owner in self._rollouts:
                raise RuntimeError(f"{owner!r} is already inside a training rollout")
            rollout = self._rollouts[owner] = TrainingRollout(owner)
        try:
            yield rollout
        finally:
            with self._lock:
                del self._rollouts[owner]
                rollout.active = False
                for slab in rollout.retired:
                    if self._owner_of.get(slab) == owner:
                        self._release(slab)

    def attended_history(self, owner: str) -> tuple[AttendedChunk, ...]:
        """Per append of ``owner``'s open training rollout: the slab ids and positions the new chunk attended to."""
        with self._lock:
            rollout = self._rollouts.get(owner)
            if rollout is None:
                raise ValueError(f"{owner!r} has no open training rollout in pool {self.name!r}")
            return tuple(rollout.history)

    def nbytes(self) -> int:
        """Bytes the pool's storage takes (0 until the first write touches it)."""
        if self._keys is None or self._values is None:
            return 0
        return 2 * self._keys.numel() * self._keys.element_size()
