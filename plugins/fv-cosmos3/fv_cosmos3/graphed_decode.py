"""The reasoner's decode step replayed from CUDA graphs, one per (batch bucket, context bucket), as vLLM does.

An eager decode step of Cosmos 3 Nano is about 2,700 small kernels: at batch 1 the launches,
not the weight reads, set its speed. :class:`GraphedDecode` captures the whole step (the
reasoner tower over the paged text-KV pool, the logits and, optionally, the sampling of the
next token) once per shape and replays it:

* Shapes are bucketed. A batch of ``B`` rows runs the graph of the smallest batch bucket
  ``>= B``; the context (the longest row's history plus the new token) runs the graph of the
  smallest context bucket that holds it (``context_bucket``: powers of two times
  ``MIN_CONTEXT``, whole blocks, capped at the pool's per-sequence maximum).
* Everything that changes from step to step is a static input buffer the graph reads: token
  ids, positions, each row's block table, the slot its new token's K/V goes to, a live-row
  mask and the sampling parameters. The pool's storage is already static (``PagedKVPool.storage``).
* Rows past the live batch are padding: they read row 0's first block and their K/V store is
  masked (a padded row stores back the value it read from a slot no live row writes this
  step), so they never change a live sequence's K/V; their outputs are cut off.
* Fewer kernels inside the graph, where exact: each RMSNorm normalises with one ``F.rms_norm``
  (a fused kernel on CUDA; bit-identical to the module's formula in fp32 on the CPU), and q
  and k get their RoPE in one elementwise pass.
* Captures are keyed by :class:`DecodeGraphKey` (weights version, batch bucket, context
  bucket, dtype, sampling) and all of them are dropped when the instance's
  ``weights_version`` changes (an RL weight sync), when the pool's storage is rebuilt, or when
  the reasoner module is replaced: a graph reads the tensors it was captured with.

On CUDA the step is captured; elsewhere (and in the CPU tests) the same static-buffer
function runs eagerly, so the capture logic is the code that is tested. Eager decode remains
the always-correct path: a batch beyond the largest bucket, or a capture that fails, runs it.

Exactness (fp32, CPU): the static step is bit-identical to the eager ``ar_token`` step when
their shapes coincide (batch = bucket, context = the longest history + 1, equal-length rows).
Padding changes shapes: a matmul over 8 rows instead of 3, attention over 256 keys instead of
38 (the padded keys masked out), and the kernels then reduce in another order, so padded
logits agree with eager to fp32 rounding (about 1e-7) rather than bit for bit; live rows'
logits do not depend on what the padded rows hold (tested bit for bit).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from fv_cosmos3.models.layers import apply_rope
from fv_cosmos3.models.mot import Cosmos3MoT

__all__ = [
    "DEFAULT_BATCH_BUCKETS",
    "MIN_CONTEXT",
    "SAMPLING_INPUTS",
    "DecodeGraphKey",
    "GraphedDecode",
    "batch_bucket",
    "context_bucket",
    "sample_tokens",
    "static_decode_step",
]

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
#: The smallest context bucket in tokens; buckets double from here (a handful of graphs per batch bucket).
MIN_CONTEXT = 256
#: The per-row inputs of graph-safe sampling, as a decode plan carries them (see ``sample_tokens``).
SAMPLING_INPUTS = ("temperature", "top_k", "top_p", "uniform", "penalty", "seen")

Tensors = dict[str, torch.Tensor]


def batch_bucket(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= ``batch``, or None when the batch is larger than every bucket."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return next((b for b in sorted(buckets) if b >= batch), None)


def context_bucket(tokens: int, *, block_size: int, max_tokens: int, minimum: int = MIN_CONTEXT) -> int:
    """The context a graph is captured for: the smallest ``minimum * 2**k`` >= ``tokens``, in whole blocks,
    at most ``max_tokens`` rounded up to whole blocks."""
    if not 1 <= tokens <= max_tokens:
        raise ValueError(f"a decode step's context must be in [1, {max_tokens}] tokens, got {tokens}")
    whole = lambda n: -(-n // block_size) * block_size  # noqa: E731
    size = max(minimum, 1)
    while size < tokens:
        size *= 2
    return min(whole(size), whole(max_tokens))


@dataclass(frozen=True)
class DecodeGraphKey:
    """What one captured decode step depends on; a step of another key never replays it."""

    weights_version: str
    bucket: int
    context: int
    dtype: str
    sampling: bool
    #: Width of the ``seen`` (presence penalty) rows a sampling step reads (0 without sampling).
    seen_width: int = 0


# --------------------------------------------------------------------------- graph-safe sampling


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    penalty: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` (B, V), with no host sync: every parameter is a (B,) tensor.

    The filters are the eager sampler's (``fv_kernel.api.sample_next_token``): the presence penalty
    subtracted from every token in ``seen`` (B, S; -1 pads), temperature 0 greedy (argmax), top-k keeps
    every logit >= the k-th largest (0: off), top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches ``top_p``. The draw differs: the eager sampler calls
    ``torch.multinomial``; here the token is the inverse CDF of the kept distribution at ``uniform``
    (B,) in [0, 1), drawn beforehand from the request's generator. Both sample the same distribution
    (up to fp32 rounding of the probabilities), but one seed gives different tokens in the two.
    """
    logits = logits.float()
    rows, vocab = logits.shape
    if seen is not None and penalty is not None:
        # A scatter into one spare column for the -1 pads: x - p for seen tokens, x - 0 (x itself) otherwise.
        hit = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=logits.device)
        hit.scatter_(1, torch.where(seen < 0, vocab, seen), 1.0)
        logits = logits - penalty.float()[:, None] * hit[:, :vocab]
    greedy = logits.argmax(dim=-1)
    hot = temperature > 0
    scaled = logits / torch.where(hot, temperature.float(), 1.0)[:, None]
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    k = top_k.to(torch.long)
    use_k = (k > 0) & (k < vocab)
    kth = ordered.gather(1, (k - 1).clamp(0, vocab - 1)[:, None])
    ordered = ordered.masked_fill(use_k[:, None] & (ordered < kth), float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs > top_p.float()[:, None]) & (top_p < 1.0)[:, None]
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    # The first sorted token whose cumulative mass exceeds u: never one of zero probability.
    target = (uniform.float().clamp(0.0, 1.0) * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True).clamp(max=vocab - 1)
    kept = (probs > 0).sum(dim=-1, keepdim=True) - 1  # rounding of u * total past the last kept token
    sampled = order.gather(1, torch.minimum(index, kept)).squeeze(1)
    return torch.where(hot, sampled, greedy)


# --------------------------------------------------------------------------- the static step


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` (an ``RMSNorm`` or ``Identity``) with the normalisation as one ``F.rms_norm`` (one fused kernel
    on CUDA, where the module's formula is five); bit-identical to the module in fp32 on the CPU, and the weight
    is applied exactly as the module applies it."""
    if isinstance(norm, torch.nn.Identity):
        return x
    input_dtype = x.dtype
    x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.eps)
    if norm.multiply_in_fp32:
        return (norm.weight.float() * x32).to(input_dtype)
    if norm.weight.dtype in (torch.float16, torch.bfloat16):
        return x32.to(norm.weight.dtype) * norm.weight
    return (x32 * norm.weight).to(input_dtype)


def static_decode_step(
    mot: Cosmos3MoT,
    store: tuple[torch.Tensor, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    *,
    context: int,
    sampling: bool,
) -> Tensors:
    """One decode step of ``buffers``' rows against the pool storage ``store``, with static shapes only.

    buffers: ``token`` (Bk, 1), ``position`` (Bk, 1) (the new token's position = the row's history
    length), ``table`` (Bk, ceil(context / block_size)) block ids (unused columns any valid id),
    ``slot_block`` / ``slot_offset`` (Bk,) where the new token's K/V goes, ``live`` (Bk,) bool, and with
    ``sampling`` the ``SAMPLING_INPUTS`` rows. Returns ``logits`` (Bk, V) fp32 (and ``token`` (Bk,)).
    The ops are the eager tower's (``Cosmos3MoT._text_tower``), in its order, except two exact fusions: each
    RMSNorm's normalisation is one ``F.rms_norm``, and q and k are rotated in one pass.
    """
    c = mot.config
    store_k, store_v = store
    token, table = buffers["token"], buffers["table"]
    bucket = token.shape[0]
    block, offset, live = buffers["slot_block"], buffers["slot_offset"], buffers["live"]
    flat = table.reshape(-1)
    cos, sin = mot._rope_tables(mot._text_position_ids(buffers["position"], bucket, 1))
    # Keys 0..position of each row (its history and the new token): no host-side length anywhere.
    may_attend = torch.arange(context, device=token.device)[None, :] <= buffers["position"]
    attn_mask = may_attend[:, None, None, :]
    keep = live[None, :, None]

    hidden = mot.embed_tokens(token)
    for i, layer in enumerate(mot.layers):
        attn = layer.self_attn
        x = _rms_norm(layer.input_layernorm, hidden)
        q = _rms_norm(attn.norm_q, mot._split_heads(attn.to_q(x), c.num_attention_heads)).transpose(1, 2)
        k = _rms_norm(attn.norm_k, mot._split_heads(attn.to_k(x), c.num_key_value_heads)).transpose(1, 2)
        v = mot._split_heads(attn.to_v(x), c.num_key_value_heads).transpose(1, 2)
        # RoPE of q and k as one pass over their heads side by side (elementwise: the same values).
        q_rot, k_rot = apply_rope(torch.cat([q, k], dim=1), cos, sin).split([q.shape[1], k.shape[1]], dim=1)
        layer_k, layer_v = store_k[i], store_v[i]  # (kv_heads, blocks, block_size, head_dim)
        # The new token's K/V into its slot; a padded row stores back what it reads (a no-op).
        for slots, new in ((layer_k, k_rot), (layer_v, v)):
            old = slots[:, block, offset]
            slots[:, block, offset] = torch.where(keep, new[:, :, 0].transpose(0, 1).to(slots.dtype), old)

        def gathered(slots: torch.Tensor) -> torch.Tensor:
            heads, _, size, dim = slots.shape
            rows = slots.index_select(1, flat).view(heads, bucket, -1, dim)[:, :, :context]
            return rows.transpose(0, 1)  # (Bk, kv_heads, context, head_dim)

        out = mot.attention(q_rot, gathered(layer_k), gathered(layer_v), is_causal=False, attn_mask=attn_mask)
        hidden = hidden + attn.to_out(out.transpose(1, 2).reshape(bucket, 1, -1))
        hidden = hidden + layer.mlp(_rms_norm(layer.post_attention_layernorm, hidden))
    logits = mot.lm_head(_rms_norm(mot.norm, hidden))[:, -1].float()
    result = {"logits": logits}
    if sampling:
        result["token"] = sample_tokens(
            logits, buffers["temperature"], buffers["top_k"], buffers["top_p"], buffers["uniform"],
            buffers["penalty"], buffers["seen"],
        )
    return result


# --------------------------------------------------------------------------- captures


class _DecodeGraph:
    """One captured step: its static buffers, and on CUDA the graph that reads them (else the same
    function run eagerly on the same buffers)."""

    def __init__(self, fn: Callable[[Tensors], Tensors], static: Tensors, *, capture: bool, pool: Any) -> None:
        self.fn = fn
        self.static = static
        self.graph: Any = None
        self.outputs: Tensors = {}
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream (lazy inits, cuBLAS handles)
                for _ in range(2):
                    fn(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs = fn(static)
            self.graph = graph

    def replay(self) -> Tensors:
        if self.graph is None:
            return self.fn(self.static)
        self.graph.replay()
        return self.outputs


class GraphedDecode:
    """The captured decode steps of one instance's reasoner over its paged text-KV pool.

    ``run`` takes an ``ar_token`` plan's inputs (``token`` (B, 1), ``table`` (B, W), ``length`` (B,), and
    optionally ``SAMPLING_INPUTS``) and returns the step's outputs for the B live rows, or None when
    the step must run eagerly (more rows than the largest bucket, or a failed capture).
    ``capture``: None captures when the pool lives on CUDA; False runs the static step eagerly
    (what the CPU tests drive).
    """

    def __init__(self, buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS, *, capture: bool | None = None,
                 min_context: int = MIN_CONTEXT) -> None:
        if not buckets or any(int(b) < 1 for b in buckets):
            raise ValueError(f"graph_batch_buckets must be positive batch sizes, got {buckets}")
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.capture = capture
        self.min_context = min_context
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0
        #: Replays by (live rows, batch bucket): whether requests' steps really ran as one call (a benchmark's
        #: scheduler batch of 8 whose rows run one by one shows (1, 1) eight times, not (8, 8) once).
        self.replayed_shapes: Counter[tuple[int, int]] = Counter()
        self._entries: dict[DecodeGraphKey, _DecodeGraph] = {}
        self._failed: set[DecodeGraphKey] = set()
        self._bound: tuple[Any, ...] | None = None  # what every entry was captured against
        self._graph_pool: Any = None

    def keys(self) -> list[DecodeGraphKey]:
        return list(self._entries)

    def invalidate(self) -> None:
        """Drop every captured step (its graph, buffers and memory pool)."""
        self._entries.clear()
        self._failed.clear()
        self._graph_pool = None

    def _check_bound(self, mot: Cosmos3MoT, store: tuple[torch.Tensor, torch.Tensor], weights_version: str) -> None:
        # A graph reads the tensors it was captured with: new weights (a sync), a rebuilt pool or another
        # module make every capture stale.
        bound = (weights_version, id(mot), store[0].data_ptr(), store[1].data_ptr(), store[0].shape)
        if bound != self._bound:
            self.invalidate()
            self._bound = bound

    def run(self, mot: Cosmos3MoT, pool: Any, weights_version: str, inputs: Mapping[str, torch.Tensor]) -> Tensors | None:
        token, lengths = inputs["token"], inputs["length"]
        if token.ndim != 2 or token.shape[1] != 1:
            return None  # several new tokens per row (a draft): the eager step
        rows = token.shape[0]
        bucket = batch_bucket(rows, self.buckets)
        if bucket is None:
            self.eager_steps += 1
            return None
        store = pool.storage()
        self._check_bound(mot, store, weights_version)
        cfg = pool.config
        lengths_host = lengths.reshape(-1).to("cpu", torch.long)
        if int(lengths_host.min()) < 1 or int(lengths_host.max()) >= cfg.max_tokens_per_sequence:
            # No history yet (the prefill's business), or no room left (the eager step raises CacheFull).
            self.eager_steps += 1
            return None
        context = context_bucket(int(lengths_host.max()) + 1, block_size=cfg.block_size,
                                 max_tokens=cfg.max_tokens_per_sequence, minimum=self.min_context)
        sampling = all(name in inputs for name in SAMPLING_INPUTS)
        table_host = inputs["table"].to("cpu", torch.long)
        for row in range(rows):
            # The eager step's checks: a freed or foreign table raises; a table without a block for the new
            # token grows in the eager step (``PagedKVPool.write_rows``), which a graph cannot do.
            length = int(lengths_host[row])
            pool.table_from_tensor(table_host[row], length)
            if length // cfg.block_size >= table_host.shape[1] or int(table_host[row, length // cfg.block_size]) < 0:
                self.eager_steps += 1
                return None
        seen_width = int(inputs["seen"].shape[-1]) if sampling else 0
        key = DecodeGraphKey(weights_version, bucket, context, str(store[0].dtype).removeprefix("torch."), sampling,
                             seen_width)
        if key in self._failed:
            self.eager_steps += 1
            return None
        host = _host_buffers(inputs, lengths_host, rows, bucket, -(-context // cfg.block_size), cfg.block_size, sampling)
        entry = self._entries.get(key)
        if entry is None:
            device = store[0].device
            # Owned copies: on the host ``to`` would hand back the caller's own tensors (a plan's token, length,
            # ``seen``), and every later step's ``copy_`` into the static buffers would overwrite them.
            static = {name: tensor.to(device, copy=True) for name, tensor in host.items()}
            capture = device.type == "cuda" if self.capture is None else self.capture

            def fn(buffers: Tensors, mot: Cosmos3MoT = mot) -> Tensors:
                return static_decode_step(mot, store, buffers, context=context, sampling=sampling)

            try:
                if capture and self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()  # one memory pool for every capture
                entry = _DecodeGraph(fn, static, capture=capture, pool=self._graph_pool)
            except Exception:  # noqa: BLE001 - a kernel that cannot be captured: this shape decodes eagerly
                log.warning("capturing the reasoner's decode step %s failed; it runs eagerly", key, exc_info=True)
                self._failed.add(key)
                self.eager_steps += 1
                return None
            self._entries[key] = entry
            self.captures += 1
        else:
            for name, tensor in host.items():
                entry.static[name].copy_(tensor, non_blocking=True)
        self.replays += 1
        self.replayed_shapes[(rows, bucket)] += 1
        outputs = entry.replay()
        # Clones: the next replay overwrites the graph's outputs.
        return {name: out[:rows].clone() for name, out in outputs.items()}


def _host_buffers(inputs: Mapping[str, torch.Tensor], lengths: torch.Tensor, rows: int, bucket: int, blocks: int,
                  block_size: int, sampling: bool) -> Tensors:
    """The static buffers' contents for ``rows`` live rows padded to ``bucket`` (on the host)."""
    pad = bucket - rows
    table = inputs["table"].to("cpu", torch.long)
    if table.shape[1] < blocks:
        table = torch.cat([table, torch.full((rows, blocks - table.shape[1]), -1, dtype=torch.long)], dim=1)
    table = table[:, :blocks]
    table = torch.where(table < 0, table[:, :1], table)  # unused columns: any block of the row (masked out)
    block = table.gather(1, (lengths // block_size).view(-1, 1)).view(-1)
    offset = lengths % block_size

    def padded(live: torch.Tensor, fill: torch.Tensor | float | int) -> torch.Tensor:
        if not pad:
            return live
        filler = fill if isinstance(fill, torch.Tensor) else torch.full((pad, *live.shape[1:]), fill, dtype=live.dtype)
        return torch.cat([live, filler.expand(pad, *live.shape[1:]).to(live.dtype)])

    # Padded rows: position 0 of row 0's first block (a slot no live row writes in a decode step).
    first = table[:1, :1]
    buffers = {
        "token": padded(inputs["token"].to("cpu", torch.long), 0),
        "position": padded(lengths.view(-1, 1), 0),
        "table": padded(table, first.expand(1, blocks)),
        "slot_block": padded(block, first.view(1)),
        "slot_offset": padded(offset, 0),
        "live": padded(torch.ones(rows, dtype=torch.bool), False),
    }
    if sampling:
        defaults = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "uniform": 0.0, "penalty": 0.0, "seen": -1}
        dtypes = {"top_k": torch.long, "seen": torch.long}
        for name in SAMPLING_INPUTS:
            value = inputs[name].to("cpu", dtypes.get(name, torch.float32))
            buffers[name] = padded(value.reshape(rows, -1) if name == "seen" else value.reshape(rows), defaults[name])
    return buffers
