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
  ids, positions, each row's block table, the slot its new token's K/V goes to (and, with padded
  rows, whose K/V it stores) and the sampling parameters. The pool's storage is already static
  (``PagedKVPool.storage``).
* Rows past the live batch are padding: they read row 0's first block and store row 0's K/V
  into row 0's slot (the same bits twice, whatever order they land in), so they never change a
  live sequence's K/V; their outputs are cut off. A full bucket (always at batch 1) has its own
  capture without that source selection.
* Fewer kernels inside the graph, each exact (``static_decode_step``): fused RMSNorms with no
  casts, q/k/v and gate/up as one linear each over weights packed into one tensor
  (``pack_weights``: the parameters become views of it, so in-place weight changes reach the
  graph and nothing is held twice), q's and k's norms and RoPE over their heads side by side,
  every layer's history gathered out of the pool once a step and every layer's new K/V stored once
  after the last layer (each layer writes its own into its copy of the history). At Nano's layer
  structure in bf16 that is 21 kernels a layer and 786 a step at batch 1, from 42 and 1,530
  (``bench/bench_ar_token.py --graphed``).
* Captures are keyed by :class:`DecodeGraphKey` (weights version, batch bucket, context
  bucket, dtype, sampling, padding) and all of them are dropped when the instance's
  ``weights_version`` changes (an RL weight sync), when the pool's storage is rebuilt, when
  the reasoner module is replaced, or when a packed weight is replaced by another tensor: a
  graph reads the tensors it was captured with.
* A chained step (``uniform`` of shape (B, n): ``compute.decode_tokens_per_step``) replays n
  times, each sampled token written into the next replay's buffers on the device
  (``_advance_buffers``); each sub-step uses the capture of its own context bucket.
* The prompt prefill is captured too, per prompt-length bucket (:class:`PrefillGraphKey`,
  :func:`static_prefill_step`), and dropped with the decode captures.

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
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from fv_cosmos3.decode_kernels import DecodeKernels, DecodeKernelsUnavailable
from fv_cosmos3.models.layers import RMSNorm, sdpa_attention
from fv_cosmos3.models.mot import Cosmos3MoT

__all__ = [
    "DEFAULT_BATCH_BUCKETS",
    "MIN_CONTEXT",
    "MIN_PREFILL",
    "SAMPLING_INPUTS",
    "DecodeGraphKey",
    "GraphedDecode",
    "PrefillGraphKey",
    "batch_bucket",
    "chain_length",
    "context_bucket",
    "logits_health",
    "sample_tokens",
    "static_decode_step",
    "static_prefill_step",
    "bounded_top_k",
    "TOP_K_BOUND",
]

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
#: The smallest context bucket in tokens; buckets double from here (a handful of graphs per batch bucket).
MIN_CONTEXT = 256
#: The smallest prompt bucket of a captured prefill; buckets double from here up to the pool's sequence limit.
MIN_PREFILL = 32
#: The per-row inputs of graph-safe sampling, as a decode plan carries them (see ``sample_tokens``).
SAMPLING_INPUTS = ("temperature", "top_k", "top_p", "uniform", "penalty", "seen")
#: A sampling step whose every sampled row keeps at most this many tokens by top-k (chat's 20, the upsampling
#: sampler's 20) takes the top ``TOP_K_BOUND`` logits (``torch.topk``) instead of sorting the whole vocabulary.
TOP_K_BOUND = 64

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
    #: Fewer live rows than the bucket: the K/V store picks each row's source (``source``); a full bucket stores
    #: every row's own K/V with two kernels a layer fewer.
    padded: bool = False
    #: ``TOP_K_BOUND`` when every sampled row's top-k is within it (the sampler sorts only that many logits), else 0.
    top_k_bound: int = 0


# --------------------------------------------------------------------------- graph-safe sampling


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    penalty: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
    *,
    top_k_bound: int = 0,
) -> torch.Tensor:
    """One token id per row of ``logits`` (B, V), with no host sync: every parameter is a (B,) tensor.

    The filters are the eager sampler's (``fv_kernel.api.sample_next_token``): the presence penalty
    subtracted from every token in ``seen`` (B, S; -1 pads), temperature 0 greedy (argmax), top-k keeps
    every logit >= the k-th largest (0: off), top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches ``top_p``. The draw differs: the eager sampler calls
    ``torch.multinomial``; here the token is the inverse CDF of the kept distribution at ``uniform``
    (B,) in [0, 1), drawn beforehand from the request's generator. Both sample the same distribution
    (up to fp32 rounding of the probabilities), but one seed gives different tokens in the two.

    ``top_k_bound`` (> 0): every sampled row has 1 <= top_k <= it (the caller checks), so only the
    ``top_k_bound`` largest logits can be kept and they alone are sorted (``torch.topk``) instead of the whole
    vocabulary: the same kept tokens in the same order, the same draw (up to the fp32 rounding of a shorter
    softmax sum). A sampled row with top-k off or above the bound would lose tokens it may draw.
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
    if top_k_bound:
        ordered, order = torch.topk(scaled, min(top_k_bound, vocab), dim=-1)  # sorted, largest first
    else:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
    width = ordered.shape[-1]
    k = top_k.to(torch.long)
    use_k = (k > 0) & (k < vocab)
    kth = ordered.gather(1, (k - 1).clamp(0, width - 1)[:, None])
    ordered = ordered.masked_fill(use_k[:, None] & (ordered < kth), float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs > top_p.float()[:, None]) & (top_p < 1.0)[:, None]
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    # The first sorted token whose cumulative mass exceeds u: never one of zero probability.
    target = (uniform.float().clamp(0.0, 1.0) * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True).clamp(max=width - 1)
    kept = (probs > 0).sum(dim=-1, keepdim=True) - 1  # rounding of u * total past the last kept token
    sampled = order.gather(1, torch.minimum(index, kept)).squeeze(1)
    return torch.where(hot, sampled, greedy)


# --------------------------------------------------------------------------- packed weights


def stacked_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(tensors)`` (along dim 0) without a copy: a view of their common storage when they are its
    consecutive contiguous blocks, in order (as :func:`pack_weights` lays them out); else None."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    end = first.storage_offset()
    for t in tensors:
        if (t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:] or t.is_meta
                or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != end):
            return None
        end += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _packable(linears: Sequence[nn.Module]) -> bool:
    """Plain ``nn.Linear`` layers (an fp8 or adapter-wrapped linear computes otherwise) with no hooks (one
    ``F.linear`` on their stacked weights would skip them), the same input, dtype and device, biases all or none."""
    if not all(type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks) for m in linears):
        return False
    weights = [m.weight for m in linears]
    return (all(w.dtype == weights[0].dtype and w.device == weights[0].device and w.shape[1] == weights[0].shape[1]
                for w in weights) and len({m.bias is None for m in linears}) == 1)


def _projections(layer: nn.Module) -> list[tuple[nn.Module, ...]]:
    """The linears of a reasoner layer that read one input: q/k/v, and gate/up (SwiGLU only)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn.to_q, attn.to_k, attn.to_v)] + ([(mlp.gate_proj, mlp.up_proj)] if mlp.hidden_act == "silu" else [])


def _joint_qk_norms(attn: nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``norm_q`` and ``norm_k`` over activations of ``dtype`` are exactly one normalisation of q's and k's
    heads side by side and a multiply by each head's gain: RMSNorms alike but for their gains, of that dtype, whose
    gain is applied after the normalisation's rounding (fp32, or the Qwen convention in bf16/fp16)."""
    norm_q, norm_k = attn.norm_q, attn.norm_k
    return (isinstance(norm_q, RMSNorm) and isinstance(norm_k, RMSNorm) and norm_q.eps == norm_k.eps
            and norm_q.multiply_in_fp32 == norm_k.multiply_in_fp32
            and norm_q.weight.dtype == norm_k.weight.dtype == dtype and norm_q.weight.device == norm_k.weight.device
            and (dtype == torch.float32 or (dtype in (torch.float16, torch.bfloat16) and not norm_q.multiply_in_fp32)))


def _gain_norms(mot: Cosmos3MoT) -> list[nn.Module] | None:
    """Every layer's ``norm_q``, then every layer's ``norm_k``, when all are joint q/k norms: packed
    (:func:`pack_weights`), one ``where`` a step builds every layer's table of per-head gains."""
    attns = [layer.self_attn for layer in mot.layers]
    if not all(_joint_qk_norms(a, mot._compute_dtype) for a in attns):
        return None
    return [a.norm_q for a in attns] + [a.norm_k for a in attns]


def _param_groups(mot: Cosmos3MoT) -> list[list[nn.Module]]:
    """The groups of modules whose ``weight`` (and ``bias``) :func:`pack_weights` lays out consecutively."""
    groups = [list(linears) for layer in mot.layers for linears in _projections(layer) if _packable(linears)]
    norms = _gain_norms(mot)
    return groups + ([norms] if norms is not None else [])


#: What :func:`pack_weights` packed, to check each step that it still holds: (the module's parameter dict, the
#: name, the parameter, its data pointer then).
PackedParams = list[tuple[dict, str, torch.Tensor, int]]


def pack_weights(mot: Cosmos3MoT) -> PackedParams:
    """Lay out the weights of each reasoner layer's q/k/v projections as consecutive rows of one tensor (and its
    gate/up, and every layer's q/k norm gains), so that one op over their stacked view (:func:`stacked_rows`)
    reads all of them: one ``F.linear`` where there were three (two), one ``where`` a step building every layer's
    table of per-head gains. The parameters become views of that tensor: names, shapes, values, ``state_dict()``
    and checkpoints stay as they were, and no second copy is kept (a derived copy would hold 9 GB more on Nano,
    and go stale when a weight changes in place). In-place changes (``load_state_dict``, an adapter merge, an RL
    sync) write into the packed rows themselves; a parameter replaced (``load_state_dict(assign=True)``, ``.to()``)
    is no longer a view of them, which :meth:`GraphedDecode._check_bound` sees on the next step, packing again.
    Modules that cannot be packed (an fp8 linear, hooks, mixed dtypes) keep their layout and run one op each."""
    packed: PackedParams = []
    for modules in _param_groups(mot):
        for name in ("weight", "bias"):
            params = [m._parameters.get(name) for m in modules]
            if params[0] is None:
                continue
            if stacked_rows(params) is None:
                # Built with inference mode and autograd off: the parameters stay ordinary tensors (an inference
                # tensor cannot be loaded into in place outside inference mode).
                with torch.inference_mode(False), torch.no_grad():
                    try:
                        whole = torch.cat([p.detach() for p in params])
                    except torch.OutOfMemoryError:
                        # No room for one group twice: it stays as it is and runs one op per module.
                        log.warning("no memory to pack %d reasoner weights; they run unpacked", len(params))
                        continue
                    start = 0
                    for param in params:
                        param.data = whole[start : start + param.shape[0]]
                        start += param.shape[0]
                if whole.is_cuda:
                    # The old tensors' blocks (of other sizes than the packed one) back to the device now: at most
                    # one group is held twice, and nothing stays reserved behind the packed copy.
                    torch.cuda.empty_cache()
            packed.extend((m._parameters, name, p, p.data_ptr()) for m, p in zip(modules, params))
    return packed


def packing_intact(packed: PackedParams) -> bool:
    """Every parameter :func:`pack_weights` packed is still that parameter, over the same memory (checked every step:
    about 35 us of host time for Nano's 252 packed parameters on the 2-core CPU machine)."""
    for params, name, param, ptr in packed:
        if params.get(name) is not param or param.data_ptr() != ptr:
            return False
    return True


def _stacked_linear(linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weight (and bias) of ``linears`` as one linear, when they are packed; else None (one call each)."""
    if not _packable(linears):
        return None
    weight = stacked_rows([m.weight for m in linears])
    if weight is None or linears[0].bias is None:
        return None if weight is None else (weight, None)
    bias = stacked_rows([m.bias for m in linears])
    return None if bias is None else (weight, bias)


@dataclass(frozen=True)
class DecodePlan:
    """The packed views a capture computes with, resolved when it is captured: per layer the q/k/v and the gate/up
    ``(weight, bias)`` (None: one linear each), and every layer's q/k norm gains (L, D) each (None: a table per
    layer). A graph reads the tensors it was captured with, and so does the CPU's eager stand-in, so a plan whose
    packing was undone afterwards is stale there as it would be on the GPU."""

    qkv: tuple[tuple[torch.Tensor, torch.Tensor | None] | None, ...]
    gate_up: tuple[tuple[torch.Tensor, torch.Tensor | None] | None, ...]
    qk_gains: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, mot: Cosmos3MoT) -> "DecodePlan":
        qkv, gate_up = [], []
        for layer in mot.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv.append(_stacked_linear((attn.to_q, attn.to_k, attn.to_v)))
            gate_up.append(_stacked_linear((mlp.gate_proj, mlp.up_proj)) if mlp.hidden_act == "silu" else None)
        norms = _gain_norms(mot)
        gains = None if norms is None else stacked_rows([n.weight for n in norms])
        qk_gains = None if gains is None else tuple(gains.view(2, len(mot.layers), -1).unbind(0))
        return cls(tuple(qkv), tuple(gate_up), qk_gains)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the static step


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` (an ``RMSNorm`` or ``Identity``) in as few kernels as give the module's result bit for bit (on the
    CPU; the same rounding steps on CUDA): fp32, or the weight multiplied in fp32 (Nemotron), is one ``F.rms_norm``
    with the weight; bf16/fp16 with the Qwen convention (round, then multiply by the low-precision weight) is
    ``F.rms_norm`` (fp32 inside, one rounding) and the multiply. No casts: ``F.rms_norm`` upcasts internally."""
    if isinstance(norm, nn.Identity):
        return x
    weight = norm.weight
    shape = (x.shape[-1],)
    if weight.dtype == x.dtype:
        if x.dtype == torch.float32 or norm.multiply_in_fp32:
            return F.rms_norm(x, shape, weight=weight, eps=norm.eps)
        if x.dtype in (torch.float16, torch.bfloat16):
            return F.rms_norm(x, shape, eps=norm.eps) * weight
    # Mixed dtypes (e.g. fp32 gains on bf16 activations): the module's formula, normalised in one op.
    input_dtype = x.dtype
    x32 = F.rms_norm(x.float(), shape, eps=norm.eps)
    if norm.multiply_in_fp32:
        return (weight.float() * x32).to(input_dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        return x32.to(weight.dtype) * weight
    return (x32 * weight).to(input_dtype)


def _qk_norm(attn: nn.Module, qk: torch.Tensor, q_heads: int, is_q: torch.Tensor,
             gains: torch.Tensor | None) -> torch.Tensor:
    """``norm_q`` over the first ``q_heads`` heads of ``qk`` (B, 1, heads, D) and ``norm_k`` over the rest: for joint
    norms (``_joint_qk_norms``) one normalisation of every head and a multiply by each head's gain (``gains``
    (heads, D), or built here from ``is_q`` (heads, 1)): two kernels where there were four to eight."""
    norm_q, norm_k = attn.norm_q, attn.norm_k
    if isinstance(norm_q, nn.Identity) and isinstance(norm_k, nn.Identity):
        return qk
    if _joint_qk_norms(attn, qk.dtype):
        gains = torch.where(is_q, norm_q.weight, norm_k.weight) if gains is None else gains
        return F.rms_norm(qk, (qk.shape[-1],), eps=norm_q.eps) * gains
    return torch.cat([_rms_norm(norm_q, qk[:, :, :q_heads]), _rms_norm(norm_k, qk[:, :, q_heads:])], dim=2)


def _linears(x: torch.Tensor, stacked: tuple[torch.Tensor, torch.Tensor | None] | None,
             linears: Sequence[nn.Module]) -> torch.Tensor:
    """The outputs of ``linears`` side by side on the last dim: one ``F.linear`` when they are packed."""
    if stacked is not None:
        return F.linear(x, *stacked)
    return torch.cat([m(x) for m in linears], dim=-1)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x2, x1] for x = [x1, x2] on the last dim: RoPE's ``rotate_half`` without its negation."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def static_decode_step(
    mot: Cosmos3MoT,
    store: tuple[torch.Tensor, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    *,
    context: int,
    sampling: bool,
    plan: DecodePlan | None = None,
    kernels: DecodeKernels | None = None,
    top_k_bound: int = 0,
) -> Tensors:
    """One decode step of ``buffers``' rows against the pool storage ``store``, with static shapes only.

    buffers: ``token`` (Bk, 1), ``position`` (Bk, 1) (the new token's position = the row's history
    length), ``table`` (Bk, ceil(context / block_size)) block ids (unused columns any valid id),
    ``slot`` (Bk,) the flat slot (block * block_size + offset) the row's new K/V goes to, with padded rows
    ``source`` (Bk,) the row whose new K/V it stores (itself; a padded row: row 0, into row 0's slot; absent:
    every row itself), and with ``sampling`` the ``SAMPLING_INPUTS`` rows. Returns ``logits`` (Bk, V) fp32 (and
    ``token`` (Bk,)).

    The values are the eager tower's (``Cosmos3MoT._text_tower``), in fewer kernels, each rewrite exact
    (bit-identical to the eager step in fp32 on the CPU, ``tests/test_graphed_decode.py``):

    * each RMSNorm is one ``F.rms_norm`` (a multiply after it for bf16 weights, the Qwen convention), no casts;
    * q, k and v are one linear over the layer's packed weights (:func:`pack_weights`), gate and up another;
    * q's and k's norms are one norm over their heads side by side and a multiply by a table of each head's gain
      (one ``where`` a step builds every layer's table from the packed gains);
    * RoPE of q and k together: ``x cos + swap(x) sin'`` with ``sin'`` = sin with its first half negated, which is
      ``rotate_half(x) sin`` exactly (negation is exact, and is applied once per step, not per layer);
    * the history of every layer is gathered once a step, each layer's new K/V written into its copy (the values
      and layout a store, then a gather, gave), and the pool stores every layer's new K/V with one ``index_copy_``
      each after the last layer (padded rows write row 0's K/V to row 0's slot: the same bits, whatever order
      duplicates land in);
    * the attention mask is made additive once a step, where SDPA would convert it in every layer (on CUDA).

    ``kernels`` (``compute.fused_ops: triton``; :func:`decode_kernels_unsupported` says which models they cover):
    each layer's residual adds with their RMSNorms, q/k's norm, gain and RoPE with the K/V writes, and SiLU with its
    multiply run as three Triton kernels (:mod:`fv_cosmos3.decode_kernels`), rounding where these ops round: the
    same values but for the order of a norm's fp32 sum (``tests/test_decode_kernels.py``).
    """
    c = mot.config
    plan = DecodePlan.of(mot) if plan is None else plan
    store_k, store_v = store
    token, table = buffers["token"], buffers["table"]
    bucket = token.shape[0]
    slot, source = buffers["slot"], buffers.get("source")
    flat = table.reshape(-1)
    q_heads, kv_heads, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    cos, sin = mot._rope_tables(mot._text_position_ids(buffers["position"], bucket, 1))  # (Bk, 1, D)
    half = dim // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    # Each layer's q/k norm gains per head (its norm_q's for q's heads, norm_k's for k's): one op for every layer
    # when their gains are packed, else one op in each layer.
    is_q = (torch.arange(q_heads + kv_heads, device=token.device) < q_heads)[:, None]
    gains = None if plan.qk_gains is None else torch.where(is_q, plan.qk_gains[0][:, None], plan.qk_gains[1][:, None])
    # Keys 0..position of each row (its history and the new token): no host-side length anywhere.
    may_attend = torch.arange(context, device=token.device)[None, :] <= buffers["position"]
    attn_mask = may_attend[:, None, None, :]
    if mot.attention is sdpa_attention:
        # SDPA turns a boolean mask into an additive one in every call (kernels in each layer on CUDA): once here,
        # the same values (0 where a key may be attended, -inf elsewhere) in the queries' dtype.
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(mot._compute_dtype)

    # Every layer's history, read out of the pool once a step: (layers, kv_heads, Bk, context, head_dim) for K and
    # for V, two kernels where each layer ran two. Each layer writes its new K/V into its rows' copies at their
    # positions (what storing, then gathering, gave: the same values in the same layout), and the pool gets every
    # layer's new K/V once, after the last layer.
    layers = store_k.shape[0]
    history_k, history_v = (store.index_select(2, flat).view(layers, kv_heads, bucket, -1, dim)[:, :, :, :context]
                            for store in (store_k, store_v))
    position = buffers["position"].view(-1)
    hidden = mot.embed_tokens(token)
    if kernels is None:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (Bk, 1, 1, D): every head of q and k
        final, rows_k, rows_v = _composed_layers(mot, plan, hidden, (cos, sin), is_q, gains, (history_k, history_v),
                                                 position, attn_mask)
    else:
        final, rows_k, rows_v = _fused_layers(mot, plan, kernels, hidden, (cos, sin), gains,
                                              (history_k, history_v), position, attn_mask)
    for store, rows in ((store_k, rows_k), (store_v, rows_v)):  # rows: (layers, Bk, kv_heads, head_dim)
        if source is not None:
            rows = rows.index_select(1, source)  # a padded row stores row 0's K/V into row 0's slot
        store.view(layers, kv_heads, -1, dim).index_copy_(2, slot, rows.transpose(1, 2))
    logits = mot.lm_head(final)[:, -1].float()
    result = {"logits": logits}
    if sampling:
        result["token"] = sample_tokens(
            logits, buffers["temperature"], buffers["top_k"], buffers["top_p"], buffers["uniform"],
            buffers["penalty"], buffers["seen"], top_k_bound=top_k_bound,
        )
    return result


Rotary = tuple[torch.Tensor, torch.Tensor]
History = tuple[torch.Tensor, torch.Tensor]


def _composed_layers(mot: Cosmos3MoT, plan: DecodePlan, hidden: torch.Tensor, rotary: Rotary, is_q: torch.Tensor,
                     gains: torch.Tensor | None, history: History, position: torch.Tensor,
                     attn_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every layer of :func:`static_decode_step` in torch ops: the final norm's output, and each layer's new K and
    V rows (layers, Bk, kv_heads, head_dim)."""
    c = mot.config
    q_heads, kv_heads, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    bucket = hidden.shape[0]
    cos, sin = rotary
    history_k, history_v = history
    every_row = torch.arange(bucket, device=hidden.device)
    new_keys: list[torch.Tensor] = []
    new_values: list[torch.Tensor] = []
    for i, layer in enumerate(mot.layers):
        attn = layer.self_attn
        x = _rms_norm(layer.input_layernorm, hidden)
        heads = _linears(x, plan.qkv[i], (attn.to_q, attn.to_k, attn.to_v)).view(bucket, 1, -1, dim)
        qk = _qk_norm(attn, heads[:, :, : q_heads + kv_heads], q_heads, is_q, None if gains is None else gains[i])
        qk = qk.transpose(1, 2)  # (Bk, Hq + Hkv, 1, D)
        qk = qk * cos + _swap_halves(qk) * sin
        q_rot, k_rot = qk[:, :q_heads], qk[:, q_heads:]
        v = heads[:, :, q_heads + kv_heads :].transpose(1, 2)
        for layer_history, new, kept in ((history_k[i], k_rot, new_keys), (history_v[i], v, new_values)):
            rows = new[:, :, 0]  # (Bk, kv_heads, head_dim)
            if rows.dtype != layer_history.dtype:
                rows = rows.to(layer_history.dtype)
            layer_history[:, every_row, position] = rows.transpose(0, 1)
            kept.append(rows)
        # (Bk, kv_heads, context, head_dim) views, strided as a per-layer gather's.
        out = mot.attention(q_rot, history_k[i].transpose(0, 1), history_v[i].transpose(0, 1), is_causal=False,
                            attn_mask=attn_mask)
        hidden = hidden + attn.to_out(out.transpose(1, 2).reshape(bucket, 1, -1))
        x = _rms_norm(layer.post_attention_layernorm, hidden)
        mlp = layer.mlp
        if mlp.hidden_act == "silu":
            gate, up = _linears(x, plan.gate_up[i], (mlp.gate_proj, mlp.up_proj)).chunk(2, dim=-1)
            hidden = hidden + mlp.down_proj(F.silu(gate) * up)
        else:
            hidden = hidden + mlp(x)
    return _rms_norm(mot.norm, hidden), torch.stack(new_keys), torch.stack(new_values)


def decode_kernels_unsupported(mot: Cosmos3MoT, plan: DecodePlan) -> str | None:
    """Why the decode kernels cannot run ``mot``'s step (None: they can). They cover RMSNorms whose weight has
    the activations' dtype, joint q/k norms with packed gains, packed q/k/v and gate/up projections, and SiLU
    MLPs: the released Cosmos 3 reasoners (Nano, Super) in bf16 or fp32."""
    dtype = mot._compute_dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"activations in {dtype}"
    norms = [mot.norm] + [n for layer in mot.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    for norm in norms:
        if not isinstance(norm, RMSNorm) or norm.weight.dtype != dtype:
            return f"a norm that is not an RMSNorm with {dtype} weights ({type(norm).__name__})"
    if plan.qk_gains is None:
        return "q/k norms that are not one RMSNorm per head with packed gains"
    if any(p is None for p in plan.qkv) or any(p is None for p in plan.gate_up):
        return "unpacked q/k/v or gate/up projections, or an MLP that is not SiLU-gated"
    if any(p[1] is not None for p in (*plan.qkv, *plan.gate_up) if p is not None):
        return "biased q/k/v or gate/up projections"
    dim = mot.config.head_dim
    if dim & (dim - 1):
        return f"head_dim {dim} (a power of two is needed)"
    return None


def _fused_layers(mot: Cosmos3MoT, plan: DecodePlan, kernels: DecodeKernels, hidden: torch.Tensor, rotary: Rotary,
                  gains: torch.Tensor | None, history: History, position: torch.Tensor,
                  attn_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_composed_layers` with the decode kernels: each residual add runs inside the next RMSNorm, q/k/v in
    one kernel that also writes K/V into the history and the rows, SiLU with its multiply."""
    reason = decode_kernels_unsupported(mot, plan)
    if reason is not None or gains is None:
        raise DecodeKernelsUnavailable(f"the decode kernels do not cover this reasoner: {reason}")
    c = mot.config
    q_heads, kv_heads, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    bucket = hidden.shape[0]
    cos, sin = (t.reshape(bucket, dim).contiguous() for t in rotary)
    history_k, history_v = history
    layers = len(mot.layers)
    rows_k = torch.empty(layers, bucket, kv_heads, dim, dtype=history_k.dtype, device=hidden.device)
    rows_v = torch.empty(layers, bucket, kv_heads, dim, dtype=history_v.dtype, device=hidden.device)
    position = position.contiguous()
    delta: torch.Tensor | None = None  # the last block's output, added to the residual by the next norm
    for i, layer in enumerate(mot.layers):
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        hidden, x = kernels.add_rms_norm(hidden, delta, norm.weight, norm.eps, round_before_weight=_rounds_first(norm))
        heads = F.linear(x, plan.qkv[i][0]).view(bucket, 1, -1, dim)  # type: ignore[index]
        q = kernels.qk_norm_rope_store(heads, gains[i], cos, sin, attn.norm_q.eps, position, (history_k[i], history_v[i]),
                                       (rows_k[i], rows_v[i]), q_heads=q_heads, kv_heads=kv_heads)
        out = mot.attention(q, history_k[i].transpose(0, 1), history_v[i].transpose(0, 1), is_causal=False,
                            attn_mask=attn_mask)
        norm = layer.post_attention_layernorm
        hidden, x = kernels.add_rms_norm(hidden, attn.to_out(out.transpose(1, 2).reshape(bucket, 1, -1)), norm.weight,
                                         norm.eps, round_before_weight=_rounds_first(norm))
        delta = mlp.down_proj(kernels.silu_mul(F.linear(x, plan.gate_up[i][0])))  # type: ignore[index]
    _, final = kernels.add_rms_norm(hidden, delta, mot.norm.weight, mot.norm.eps, round_before_weight=_rounds_first(mot.norm))
    return final, rows_k, rows_v


def _rounds_first(norm: RMSNorm) -> bool:
    """Whether ``norm`` rounds its normalised row before the weight multiplies it (the Qwen convention in bf16/fp16;
    in fp32 the rounding is a no-op either way)."""
    return not norm.multiply_in_fp32


@dataclass(frozen=True)
class PrefillGraphKey:
    """What one captured prompt prefill depends on: prompts of any length up to ``length`` replay it."""

    weights_version: str
    length: int
    dtype: str


def static_prefill_step(mot: Cosmos3MoT, store: tuple[torch.Tensor, torch.Tensor], buffers: Mapping[str, torch.Tensor]) -> Tensors:
    """One prompt's prefill with static shapes: the reasoner tower's own forward over the prompt right-padded to
    the bucket, its K/V stored into the pool, the logits of the last real token.

    buffers: ``ids`` (1, L) (the prompt, then padding), ``position`` (1, L) (0 .. L-1), ``slot`` (L,) the flat slot
    of each position's K/V, ``source`` (L,) the position whose K/V goes there, ``last`` (1,) the last real
    position. Padded positions store the last real position's K/V into its own slot (the same bits twice, as the
    decode step's padded rows do), so no slot past the prompt is written. Causal attention keeps every real
    position's K/V and the last real logits free of the padding. Returns ``logits`` (1, V) fp32."""
    result = mot._text_tower(buffers["ids"], buffers["position"], None, "reasoner", skip_last_mlp=False)
    assert result.hidden is not None
    store_k, store_v = store
    source, slot = buffers["source"], buffers["slot"]
    for layer, (keys, values) in enumerate(zip(result.kv.keys, result.kv.values)):
        for slots, new in ((store_k[layer], keys), (store_v[layer], values)):
            heads, _, _, dim = slots.shape
            rows = new[0].index_select(1, source)  # (kv_heads, L, head_dim)
            if rows.dtype != slots.dtype:
                rows = rows.to(slots.dtype)
            slots.view(heads, -1, dim).index_copy_(1, slot, rows)
    hidden = result.hidden.index_select(1, buffers["last"])
    return {"logits": mot._logits(hidden, False)[:, -1].float()}


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
            # thread_local: a decode on the other device lane (scheduler.overlap_kinds) may allocate meanwhile.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
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
                 min_context: int = MIN_CONTEXT, min_prefill: int = MIN_PREFILL,
                 kernels: DecodeKernels | None = None) -> None:
        if not buckets or any(int(b) < 1 for b in buckets):
            raise ValueError(f"graph_batch_buckets must be positive batch sizes, got {buckets}")
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.capture = capture
        #: The Triton decode kernels every decode step is captured with (``compute.fused_ops: triton``), or None.
        self.kernels = kernels
        self.min_context = min_context
        self.min_prefill = min_prefill
        self.captures = 0
        self.replays = 0
        #: Of ``replays``, the prompt prefills (one per row).
        self.prefill_replays = 0
        self.eager_steps = 0
        #: Replays by (live rows, batch bucket): whether requests' steps really ran as one call (a benchmark's
        #: scheduler batch of 8 whose rows run one by one shows (1, 1) eight times, not (8, 8) once).
        self.replayed_shapes: Counter[tuple[int, int]] = Counter()
        self._entries: dict[DecodeGraphKey | PrefillGraphKey, _DecodeGraph] = {}
        self._failed: set[DecodeGraphKey | PrefillGraphKey] = set()
        self._bound: tuple[Any, ...] | None = None  # what every entry was captured against
        self._packed: PackedParams = []  # the projection weights the entries read packed (``pack_weights``)
        self._graph_pool: Any = None

    def keys(self) -> list[DecodeGraphKey]:
        """The captured decode steps' keys."""
        return [key for key in self._entries if isinstance(key, DecodeGraphKey)]

    def prefill_keys(self) -> list[PrefillGraphKey]:
        """The captured prompt prefills' keys."""
        return [key for key in self._entries if isinstance(key, PrefillGraphKey)]

    def replay(self, key: DecodeGraphKey, *, captured: bool = True) -> Tensors:
        """Run one captured step on its static buffers as the last step left them, without the host's work of
        filling them (a benchmark's measure of the step alone). ``captured=False`` runs the same static step
        eagerly, kernel by kernel (what a profiler can attribute op by op). It writes the K/V of the last step's
        rows into their slots again: use it only when no sequence that step served is still decoding."""
        entry = self._entries[key]
        return entry.replay() if captured else entry.fn(entry.static)

    def invalidate(self) -> None:
        """Drop every captured step (its graph, buffers and memory pool)."""
        self._entries.clear()
        self._failed.clear()
        self._graph_pool = None

    def _check_bound(self, mot: Cosmos3MoT, store: tuple[torch.Tensor, torch.Tensor], weights_version: str) -> None:
        # A graph reads the tensors it was captured with: new weights (a sync), a rebuilt pool, another module, or
        # a packed projection weight replaced by another tensor (its graph would read the old packed rows) make
        # every capture stale. Each binding packs the projections (a no-op when they still are).
        bound = (weights_version, id(mot), store[0].data_ptr(), store[1].data_ptr(), store[0].shape)
        if bound != self._bound or not packing_intact(self._packed):
            self.invalidate()
            self._packed = pack_weights(mot)
            if self.kernels is not None:
                reason = decode_kernels_unsupported(mot, DecodePlan.of(mot))
                if reason is not None:  # the request fails with the reason; nothing runs slower unasked
                    raise DecodeKernelsUnavailable(f"compute.fused_ops='triton': the decode kernels do not cover "
                                                   f"this reasoner ({reason}); use fused_ops 'off'")
            self._bound = bound

    def run(self, mot: Cosmos3MoT, pool: Any, weights_version: str, inputs: Mapping[str, torch.Tensor]) -> Tensors | None:
        """The step's outputs for the live rows (``logits`` and, sampling, ``token``; a chained step, whose
        ``uniform`` is (B, n), ``tokens`` (B, n) and ``health``, see :func:`chain_length`), or None: eager."""
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
        chain = chain_length(inputs)
        lengths_host = lengths.reshape(-1).to("cpu", torch.long)
        if int(lengths_host.min()) < 1 or int(lengths_host.max()) + chain > cfg.max_tokens_per_sequence:
            # No history yet (the prefill's business), or no room left (the eager step raises CacheFull).
            self.eager_steps += 1
            return None
        # Sub-step j attends over the context a one-token step there would: chained tokens are those tokens.
        contexts = [context_bucket(int(lengths_host.max()) + 1 + j, block_size=cfg.block_size,
                                   max_tokens=cfg.max_tokens_per_sequence, minimum=self.min_context)
                    for j in range(chain)]
        sampling = all(name in inputs for name in SAMPLING_INPUTS)
        if chain > 1 and not sampling:
            return None  # the eager step names what is missing
        table_host = inputs["table"].to("cpu", torch.long)
        for row in range(rows):
            # The eager step's checks: a freed or foreign table raises; a table without a block for each new
            # token grows in the eager step (``PagedKVPool.write_rows``), which a graph cannot do.
            length = int(lengths_host[row])
            pool.table_from_tensor(table_host[row], length)
            needed = range(length // cfg.block_size, (length + chain - 1) // cfg.block_size + 1)
            if needed.stop > table_host.shape[1] or bool((table_host[row, needed.start:needed.stop] < 0).any()):
                self.eager_steps += 1
                return None
        seen_width = int(inputs["seen"].shape[-1]) if sampling else 0
        dtype = str(store[0].dtype).removeprefix("torch.")
        bound = bounded_top_k(inputs) if sampling else 0
        keys = [DecodeGraphKey(weights_version, bucket, context, dtype, sampling, seen_width, padded=rows < bucket,
                               top_k_bound=bound) for context in contexts]
        if any(key in self._failed for key in keys):
            self.eager_steps += 1
            return None
        step_inputs = dict(inputs)
        uniforms = None
        if chain > 1:
            uniforms = inputs["uniform"].to("cpu", torch.float32).reshape(rows, chain)
            step_inputs["uniform"] = uniforms[:, 0]
        host = _host_buffers(step_inputs, lengths_host, rows, bucket, -(-contexts[-1] // cfg.block_size),
                             cfg.block_size, sampling)
        device = store[0].device
        if uniforms is not None:
            # Each sub-step's uniform, and the first free ``seen`` column of each row (its own tokens go there).
            uniforms = torch.cat([uniforms, torch.zeros(bucket - rows, chain)]).to(device)
            seen_free = (host["seen"] >= 0).sum(dim=1)
            if int(seen_free.max()) + chain - 1 > seen_width:
                self.eager_steps += 1
                return None
            seen_free = seen_free.to(device)
        tokens = health = None
        entry: _DecodeGraph | None = None
        outputs: Tensors = {}
        for j, key in enumerate(keys):
            previous = entry
            entry = self._entries.get(key)
            if entry is None or entry is not previous:
                blocks = -(-key.context // cfg.block_size)
                own = {name: (tensor[:, :blocks] if name == "table" else tensor) for name, tensor in host.items()}
                if entry is None:
                    # Owned copies: on the host ``to`` would hand back the caller's own tensors (a plan's token,
                    # length, ``seen``), and every later step's ``copy_`` into the static buffers would overwrite them.
                    static = {name: tensor.to(device, copy=True) for name, tensor in own.items()}
                else:
                    static = entry.static
                    for name, tensor in own.items():
                        static[name].copy_(tensor, non_blocking=True)
            else:
                static = entry.static
            if j:
                assert previous is not None and uniforms is not None
                _advance_buffers(static, previous.static, outputs["token"], uniforms[:, j], seen_free + (j - 1),
                                 cfg.block_size)
            if entry is None:
                # Captured on buffers that hold this sub-step's inputs: the capture's warm-up runs write this step's
                # K/V, the same bits the replay writes again.
                entry = self._capture(mot, store, key, static)
                if entry is None:
                    return None  # the eager step redoes the whole step: it rewrites whatever K/V this one wrote
            self.replays += 1
            self.replayed_shapes[(rows, bucket)] += 1
            outputs = entry.replay()
            if chain == 1:
                # Clones: the next replay overwrites the graph's outputs.
                return {name: out[:rows].clone() for name, out in outputs.items()}
            if tokens is None:
                tokens = torch.empty(bucket, chain, dtype=torch.long, device=device)
                health = torch.zeros(bucket, dtype=torch.float32, device=device)
            tokens[:, j] = outputs["token"]
            health = health + logits_health(outputs["logits"])
        assert tokens is not None and health is not None
        return {"tokens": tokens[:rows], "health": health[:rows]}

    def prefill(self, mot: Cosmos3MoT, pool: Any, weights_version: str, inputs: Mapping[str, torch.Tensor]) -> Tensors | None:
        """An ``ar_prefill`` plan's outputs (``logits`` (B, V)) from captured prefills, one replay per row, each prompt
        right-padded to its length bucket (``context_bucket`` from :data:`MIN_PREFILL`); None: the eager prefill."""
        ids = inputs["ids"]
        rows, length = ids.shape
        cfg = pool.config
        if not 1 <= length <= cfg.max_tokens_per_sequence:
            self.eager_steps += 1
            return None  # the eager prefill names the problem
        store = pool.storage()
        self._check_bound(mot, store, weights_version)
        bucket = context_bucket(length, block_size=cfg.block_size, max_tokens=cfg.max_tokens_per_sequence,
                                minimum=self.min_prefill)
        key = PrefillGraphKey(weights_version, bucket, str(store[0].dtype).removeprefix("torch."))
        if key in self._failed:
            self.eager_steps += 1
            return None
        table_host = inputs["table"].to("cpu", torch.long)
        if table_host.shape[1] * cfg.block_size < length:
            self.eager_steps += 1
            return None  # the eager prefill grows the table
        positions = torch.arange(length)
        pad = bucket - length
        # The same for every row: positions, which position each slot takes its K/V from, the last real one.
        shared = {"position": torch.arange(bucket).view(1, -1),
                  "source": torch.cat([positions, positions[-1:].expand(pad)]), "last": torch.tensor([length - 1])}
        hosts = []
        for row in range(rows):
            pool.table_from_tensor(table_host[row], 0)  # a freed or foreign table raises, as in the eager prefill
            blocks = table_host[row, positions // cfg.block_size]
            if bool((blocks < 0).any()):
                self.eager_steps += 1
                return None  # the eager prefill grows the table
            slot = blocks * cfg.block_size + positions % cfg.block_size
            hosts.append({
                **shared,
                "ids": torch.cat([ids[row].to("cpu", torch.long), torch.zeros(pad, dtype=torch.long)]).view(1, -1),
                "slot": torch.cat([slot, slot[-1:].expand(pad)]),
            })
        logits = []
        for host in hosts:
            entry = self._entries.get(key)
            if entry is None:
                static = {name: tensor.to(store[0].device, copy=True) for name, tensor in host.items()}
                entry = self._capture(mot, store, key, static)
                if entry is None:
                    return None  # the eager prefill rewrites whatever K/V the rows before wrote
            else:
                for name, tensor in host.items():
                    entry.static[name].copy_(tensor, non_blocking=True)
            self.replays += 1
            self.prefill_replays += 1
            logits.append(entry.replay()["logits"].clone())  # the next replay overwrites the graph's output
        return {"logits": torch.cat(logits)}

    def _capture(self, mot: Cosmos3MoT, store: tuple[torch.Tensor, torch.Tensor], key: "DecodeGraphKey | PrefillGraphKey",
                 static: Tensors) -> "_DecodeGraph | None":
        """A new capture of ``key`` on ``static`` (None, and the key marked failed, if it cannot be captured)."""
        capture = store[0].device.type == "cuda" if self.capture is None else self.capture
        fn: Callable[[Tensors], Tensors]
        if isinstance(key, PrefillGraphKey):
            def fn(buffers: Tensors, mot: Cosmos3MoT = mot) -> Tensors:
                return static_prefill_step(mot, store, buffers)
        else:
            def fn(buffers: Tensors, mot: Cosmos3MoT = mot, plan: DecodePlan = DecodePlan.of(mot),
                   context: int = key.context, sampling: bool = key.sampling, bound: int = key.top_k_bound) -> Tensors:
                return static_decode_step(mot, store, buffers, context=context, sampling=sampling, plan=plan,
                                          kernels=self.kernels, top_k_bound=bound)

        try:
            if capture and self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()  # one memory pool for every capture
            entry = _DecodeGraph(fn, static, capture=capture, pool=self._graph_pool)
        except Exception:  # noqa: BLE001 - a kernel that cannot be captured: this shape decodes eagerly
            log.warning("capturing the reasoner's %s failed; it runs eagerly", key, exc_info=True)
            self._failed.add(key)
            self.eager_steps += 1
            return None
        self._entries[key] = entry
        self.captures += 1
        return entry


def bounded_top_k(inputs: Mapping[str, torch.Tensor]) -> int:
    """:data:`TOP_K_BOUND` when every row that samples (temperature > 0) keeps at most that many tokens by top-k,
    else 0 (the step sorts the whole vocabulary); greedy rows take the argmax either way."""
    hot = inputs["temperature"].reshape(-1).to("cpu") > 0
    k = inputs["top_k"].reshape(-1).to("cpu", torch.long)[hot]
    return TOP_K_BOUND if bool(((k >= 1) & (k <= TOP_K_BOUND)).all()) else 0


def chain_length(inputs: Mapping[str, torch.Tensor]) -> int:
    """Tokens a decode step's inputs ask for: ``n`` when its ``uniform`` is (B, n), one draw per sub-step (a
    chained step: each sub-step samples a token and feeds it to the next, on the device), else 1."""
    uniform = inputs.get("uniform")
    return int(uniform.shape[1]) if uniform is not None and uniform.ndim == 2 else 1


def logits_health(logits: torch.Tensor) -> torch.Tensor:
    """(B,) fp32: 0 where a row of ``logits`` is finite, NaN where it holds a NaN or an Inf (``x - x``). A chained
    step returns the sum over its sub-steps, so the executor's NaN/Inf check sees every sub-step's logits."""
    low, high = torch.aminmax(logits.float(), dim=-1)
    return (low - low) + (high - high)


def _advance_buffers(static: Tensors, previous: Tensors, sampled: torch.Tensor, uniform: torch.Tensor,
                     seen_column: torch.Tensor, block_size: int) -> None:
    """Fill ``static`` with the next sub-step's inputs, on the device: the token ``previous`` sampled, its position
    plus one, that position's slot, the next uniform, and the sampled token recorded in ``seen`` (at each row's
    ``seen_column``). ``static`` may be ``previous`` (the same capture) or another capture's buffers (a wider
    context): its table and sampling parameters are already the step's."""
    position = previous["position"] + 1
    static["position"].copy_(position)
    static["token"].copy_(sampled.view(-1, 1))
    if "seen" in static:
        if static is not previous:
            static["seen"].copy_(previous["seen"])
        static["seen"].scatter_(1, seen_column.view(-1, 1), sampled.view(-1, 1))
    flat = position.view(-1)
    slot = static["table"].gather(1, (flat // block_size).view(-1, 1)).view(-1) * block_size + flat % block_size
    if "source" in static:
        slot = slot.index_select(0, static["source"])  # a padded row stores row 0's K/V into row 0's slot
    static["slot"].copy_(slot)
    static["uniform"].copy_(uniform)


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

    # Padded rows read row 0's first block at position 0, and store row 0's new K/V into row 0's slot (the same
    # bits twice in one slot: no live slot gets anything but its own row's K/V).
    first = table[:1, :1]
    slot = block * block_size + offset
    buffers = {
        "token": padded(inputs["token"].to("cpu", torch.long), 0),
        "position": padded(lengths.view(-1, 1), 0),
        "table": padded(table, first.expand(1, blocks)),
        "slot": padded(slot, slot[:1]),
    }
    if pad:
        buffers["source"] = padded(torch.arange(rows), 0)
    if sampling:
        defaults = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "uniform": 0.0, "penalty": 0.0, "seen": -1}
        dtypes = {"top_k": torch.long, "seen": torch.long}
        for name in SAMPLING_INPUTS:
            value = inputs[name].to("cpu", dtypes.get(name, torch.float32))
            buffers[name] = padded(value.reshape(rows, -1) if name == "seen" else value.reshape(rows), defaults[name])
    return buffers
