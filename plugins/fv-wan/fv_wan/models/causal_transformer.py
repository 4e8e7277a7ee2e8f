"""Block-causal, chunk-wise forward of the Wan DiT (Self-Forcing / CausVid inference).

The weights are plain Wan (:class:`~fv_wan.models.transformer.WanTransformer`); causality
comes only from what a chunk's queries attend to. One call runs one chunk of
``frames_per_chunk`` latent frames: its self-attention attends to the committed K/V of
earlier chunks (the sink and local window the caller hands in, per layer) followed by the
chunk's own K/V. RoPE uses absolute latent-frame indices (the chunk's first frame is
``start_frame``), so K is stored after RoPE and V raw, as SF's ``causal_model.py`` does.
Cross-attention is Wan's, to the prompt embeddings of the call.

The forward is a function over the bidirectional model's modules, so the bidirectional path
(``WanTransformer.forward``) stays untouched.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from fv_wan.models.transformer import (
    FusedOps,
    WanBlockInputs,
    WanTransformer,
    WanTransformerBlock,
    _attend,
    _fp32_layer_norm,
    _split_heads,
    apply_rotary,
)

__all__ = ["LayerKV", "LayerHistory", "KVSink", "chunk_rotary", "causal_chunk_forward", "causal_batch_forward", "tokens_per_frame"]

#: One layer's committed K/V: ``k`` after RoPE and ``v`` raw, both (B, tokens, heads, head_dim).
LayerKV = tuple[torch.Tensor, torch.Tensor]
#: Receives each layer's K (after RoPE) and V of the chunk: ``sink(layer, k, v)``, (B, tokens, heads, head_dim).
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]


def tokens_per_frame(model: WanTransformer, height: int, width: int) -> int:
    """Tokens of one latent frame of ``height`` x ``width`` latents."""
    _, p_h, p_w = model.config.patch_size
    return (height // p_h) * (width // p_w)


def chunk_rotary(model: WanTransformer, grid: tuple[int, int, int], start_frame: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) of a chunk's token grid whose first latent frame is ``start_frame`` (absolute)."""
    frames, height, width = grid
    rope = model.rope
    if start_frame < 0 or start_frame + frames > rope.max_seq_len or max(height, width) > rope.max_seq_len:
        raise ValueError(
            f"chunk frames [{start_frame}, {start_frame + frames}) x {height} x {width} exceed the RoPE table "
            f"(rope_max_seq_len={rope.max_seq_len} positions per axis)"
        )
    halves = [dim // 2 for dim in rope.axis_dims]
    outputs = []
    for table in (rope.cos_table.float(), rope.sin_table.float()):
        t_part, h_part, w_part = table.split(halves, dim=1)
        t_part = t_part[start_frame : start_frame + frames]
        grid_table = torch.cat(
            [
                t_part[:, None, None, :].expand(frames, height, width, -1),
                h_part[None, :height, None, :].expand(frames, height, width, -1),
                w_part[None, None, :width, :].expand(frames, height, width, -1),
            ],
            dim=-1,
        )
        outputs.append(grid_table.reshape(frames * height * width, 1, -1))
    return outputs[0], outputs[1]


#: ``attention(q, k, v)`` over (B, L, heads, head_dim); also the self-attention core's signature.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SelfAttentionCore = AttentionFn


def _causal_block(
    block: WanTransformerBlock, x: torch.Tensor, inputs: WanBlockInputs, self_attention: SelfAttentionCore,
    attention_fn: AttentionFn, fused_ops: FusedOps = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``WanTransformerBlock.forward`` with its self-attention core replaced by ``self_attention``
    (the chunk's queries, K after RoPE and V -> attended values; it adds the history in front of K/V);
    with ``fused_ops`` (the model's, ``compute.fused_ops``) its elementwise glue runs in those fused passes,
    as ``WanTransformerBlock._forward_fused`` does.

    Returns the block output and the chunk's K (after RoPE) and V for the cache.
    """
    shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = (
        block.scale_shift_table + inputs.timestep_proj.float()
    ).unbind(2)
    attn = block.attn1
    if fused_ops is not None:
        return _causal_block_fused(block, x, inputs, self_attention, attention_fn, fused_ops,
                                   (shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff))
    normed = (_fp32_layer_norm(block.norm1, x) * (1 + scale_sa) + shift_sa).type_as(x)
    query = attn._query(normed)
    key, value = attn._key_value(normed)
    cos, sin = inputs.rotary
    query = apply_rotary(query, cos, sin)
    key = apply_rotary(key, cos, sin)
    attended = attn._project_out(self_attention(query, key, value), query)
    x = (x.float() + attended * gate_sa).type_as(x)

    normed = _fp32_layer_norm(block.norm2, x).type_as(x) if isinstance(block.norm2, torch.nn.LayerNorm) else x
    x = x + block.attn2.cross_attention(normed, inputs.context, inputs.context_image, attention_fn)

    normed = (_fp32_layer_norm(block.norm3, x) * (1 + scale_ff) + shift_ff).type_as(x)
    return (x.float() + block.ffn(normed).float() * gate_ff).type_as(x), key, value


def _causal_block_fused(
    block: WanTransformerBlock, x: torch.Tensor, inputs: WanBlockInputs, self_attention: SelfAttentionCore,
    attention_fn: AttentionFn, ops: FusedOps, modulation: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_causal_block` with the fused ops: the modulated norms, the residual adds with the next norm, and
    q's and k's RMSNorm with their RoPE in one pass each (one table per row when rows start at different frames)."""
    shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = modulation
    attn = block.attn1
    normed = block.fused_norm1(ops, x, scale_sa, shift_sa)
    query = _rows_normed_heads(attn, attn.norm_q, attn.to_q(normed), ops, inputs.rotary)
    key = _rows_normed_heads(attn, attn.norm_k, attn.to_k(normed), ops, inputs.rotary)
    value = _split_heads(attn.to_v(normed), attn.heads)
    attended = attn._project_out(self_attention(query, key, value), query)
    x, normed = block.fused_norm2(ops, x, attended, gate_sa)
    crossed = block.attn2.cross_attention_fused(normed, inputs.context, inputs.context_image, attention_fn, ops)
    x, normed = block.fused_norm3(ops, x, crossed, scale_ff, shift_ff)
    return ops.gated_residual(x, block.ffn.forward_fused(normed, ops), gate_ff), key, value


def _rows_normed_heads(attn: torch.nn.Module, norm: torch.nn.RMSNorm, projected: torch.Tensor, ops: FusedOps,
                       rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RMSNorm + RoPE of (B, L, H*D) ``projected`` -> (B, L, H, D); a (B, L, 1, D/2) table (rows at different start
    frames, :func:`_rows_rotary`) rotates each row by its own table."""
    cos, sin = rotary
    if cos.dim() == 3:
        return attn._normed_heads(norm, projected, ops, rotary)
    return torch.cat([attn._normed_heads(norm, projected[row : row + 1], ops, (cos[row], sin[row]))
                      for row in range(projected.shape[0])])


class LayerHistory(abc.ABC):
    """One layer's committed K/V that can be read with room for the chunk's own K/V after it: a history kept
    elsewhere (the slab pool) gives the attention its keys in one copy instead of a read and a concatenation."""

    @abc.abstractmethod
    def with_chunk(self, key: torch.Tensor, value: torch.Tensor) -> LayerKV:
        """[history, ``key``] and [history, ``value``], each (1, history + tokens, heads, head_dim)."""


def _over_history(history: LayerKV | LayerHistory | None, attention_fn: AttentionFn) -> SelfAttentionCore:
    """Every row's queries over [``history``, its own K/V] (one history for all rows: same length)."""

    def core(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if isinstance(history, LayerHistory):
            key, value = history.with_chunk(key, value)
        elif history is not None and history[0].shape[1] > 0:
            key = torch.cat([history[0].to(key.dtype), key], dim=1)
            value = torch.cat([history[1].to(value.dtype), value], dim=1)
        return _attend(attention_fn, query, key, value)

    return core


def _per_row(histories: Sequence[LayerKV | None], attention_fn: AttentionFn) -> SelfAttentionCore:
    """Row ``b``'s queries over [``histories[b]``, row b's own K/V]: B sessions' chunks in one forward.

    Per row rather than one padded call with a key-padding mask: rows keep the unmasked attention
    backend (flash/cuDNN on CUDA), nothing is padded or copied, and on CPU the loop was as fast or
    faster (docs/realtime.md, "Batching sessions").
    """

    def core(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        rows = [_over_history(history, attention_fn)(query[r : r + 1], key[r : r + 1], value[r : r + 1])
                for r, history in enumerate(histories)]
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    return core


def causal_chunk_forward(
    model: WanTransformer,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    *,
    start_frame: int,
    history: Sequence[LayerKV | None] | None = None,
    kv_sink: KVSink | None = None,
    attention_fn: AttentionFn | None = None,
) -> torch.Tensor:
    """The flow prediction (B, C_out, F, H, W) of one chunk ``latents`` (B, C, F, H, W).

    ``history[layer]``: the committed K/V the chunk attends to before its own (sink and local
    window, in attention order), or None/empty for the first chunk. ``kv_sink``, when given,
    receives the chunk's own K/V per layer (the KV refresh writes them into the chunk's slab).
    ``start_frame``: the chunk's first latent frame in the stream (RoPE position).
    """
    if history is not None and len(history) != model.num_layers:
        raise ValueError(f"history must hold one K/V pair per layer ({model.num_layers}), got {len(history)}")
    inputs = model.prepare(latents, timestep, encoder_hidden_states)
    inputs = dataclasses.replace(inputs, rotary=chunk_rotary(model, inputs.grid_sizes, start_frame))
    # The eager attention backend of the model (SDPA unless swapped); no mask: block-causal by construction.
    attend = attention_fn or model.attention_fn or F.scaled_dot_product_attention
    x = inputs.x
    for index, block in enumerate(model.blocks):
        layer = history[index] if history is not None else None
        x, key, value = _causal_block(block, x, inputs, _over_history(layer, attend), attend, model.fused_ops)
        if kv_sink is not None:
            kv_sink(index, key, value)
    return model.finish(x, inputs)


def _rows_rotary(model: WanTransformer, grid: tuple[int, int, int], start_frames: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for rows whose chunks start at ``start_frames``: (L, 1, D/2) when all rows agree, else
    (B, L, 1, D/2) (one table per row; ``apply_rotary`` broadcasts either over (B, L, H, D/2))."""
    if len(set(start_frames)) == 1:
        return chunk_rotary(model, grid, start_frames[0])
    tables = [chunk_rotary(model, grid, start) for start in start_frames]
    return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])


def causal_batch_forward(
    model: WanTransformer,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    *,
    start_frames: Sequence[int],
    histories: Sequence[Sequence[LayerKV | None] | None],
    kv_sinks: Sequence[KVSink | None] | None = None,
    attention_fn: AttentionFn | None = None,
) -> torch.Tensor:
    """:func:`causal_chunk_forward` of B chunks of B different streams in one forward.

    Row ``b`` is one stream's chunk: ``latents[b]`` at ``timestep[b]`` with prompt
    ``encoder_hidden_states[b]``, its first latent frame at ``start_frames[b]`` (RoPE), attending
    to ``histories[b]`` (per layer, (1, tokens_b, heads, head_dim); tokens_b may differ between
    rows and be 0) and its own K/V; ``kv_sinks[b]``, when not None, receives row b's K/V per
    layer as (1, tokens, heads, head_dim). All rows share the chunk shape.
    """
    batch = latents.shape[0]
    if len(start_frames) != batch or len(histories) != batch or (kv_sinks is not None and len(kv_sinks) != batch):
        raise ValueError(f"start_frames, histories and kv_sinks need one entry per row ({batch} rows), got "
                         f"{len(start_frames)}, {len(histories)}, {len(kv_sinks) if kv_sinks is not None else None}")
    for history in histories:
        if history is not None and len(history) != model.num_layers:
            raise ValueError(f"history must hold one K/V pair per layer ({model.num_layers}), got {len(history)}")
    if timestep.ndim != 1 or timestep.shape[0] not in (1, batch):
        raise ValueError(f"timestep must be (B,) = ({batch},) or (1,), got {tuple(timestep.shape)}")
    inputs = model.prepare(latents, timestep, encoder_hidden_states)
    inputs = dataclasses.replace(inputs, rotary=_rows_rotary(model, inputs.grid_sizes, list(start_frames)))
    attend = attention_fn or model.attention_fn or F.scaled_dot_product_attention
    x = inputs.x
    for index, block in enumerate(model.blocks):
        layer = [h[index] if h is not None else None for h in histories]
        x, key, value = _causal_block(block, x, inputs, _per_row(layer, attend), attend, model.fused_ops)
        if kv_sinks is not None:
            for row, sink in enumerate(kv_sinks):
                if sink is not None:
                    sink(index, key[row : row + 1], value[row : row + 1])
    return model.finish(x, inputs)
