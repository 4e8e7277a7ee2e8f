"""Wan's parallel implementation (the cards' ``parallelism.implementation``).

* **Sequence parallel** (``sp`` = ulysses x ring): the DiT prepares its inputs on every rank
  (patch embedding, text and timestep embeddings: cheap, and identical), then each rank
  keeps its chunk of the token sequence (and of the RoPE table and, for per-token
  timesteps, of the modulation) through the block stack. Self-attention is the kernel's
  :class:`SequenceParallelAttention` (Ulysses all-to-all over heads, ring over blocks, or
  both); cross-attention to the text is local (every rank has the whole context). The
  chunks are gathered before the output head, which runs on the whole sequence.
* **CFG parallel** (``cfgp`` = 2): the rows of a step (guidance branches, and requests
  when fused) are dealt round-robin over the cfgp group, so with one request each branch
  runs on its own rank; the rows are gathered back in their original order, so every
  rank holds the same full output and the guidance combine (done by the loop on rank 0)
  reads exactly what a single device would. Rows that do not divide evenly (one branch at
  guidance 1) run on every rank of the group.
* **Parallel VAE decode** (``vae`` = every rank of the replica): row strips with halo
  exchange, :mod:`fv_wan.parallel_vae`. Wan 2.1 VAE cards only.
* The text and image encoders (and the VAE when ``vae`` is 1) run whole on rank 0
  (``is_collective``: only the collective ops are broadcast to the other ranks).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from fv_kernel.api import (
    ModelCard,
    ModelInstance,
    ParallelPlan,
    ParallelPlanError,
    ParallelRuntime,
    Request,
    SequenceParallelAttention,
    StepOp,
    gather_sequence,
    rows_adapted,
    shard_sequence,
)
from fv_wan.instance import adapter_routing, dit_inputs, wan_ops
from fv_wan.models.transformer import WanBlockInputs, WanTransformer, WanTransformerConfig
from fv_wan.models.vae import WanVAEConfig
from fv_wan.parallel_vae import parallel_decode_op

__all__ = ["WanParallel", "WAN_PARALLEL", "parallel_dit_op", "wan_tokens"]


def wan_tokens(card: ModelCard, frames: int, height: int, width: int) -> int:
    """Post-patch tokens of one sample at a pixel shape."""
    vae = WanVAEConfig.from_diffusers_config(card.components["vae_decoder"].config)
    transformer = WanTransformerConfig.from_diffusers_config(card.components["transformer"].config)
    p_t, p_h, p_w = transformer.patch_size
    latent_frames = (frames - 1) // vae.temporal_compression + 1
    s = vae.spatial_compression
    return (latent_frames // p_t) * (height // s // p_h) * (width // s // p_w)


def _check_vae_rows(card: ModelCard, height: int, plan: ParallelPlan) -> None:
    """The parallel VAE decode splits the latent rows evenly."""
    rows = height // WanVAEConfig.from_diffusers_config(card.components["vae_decoder"].config).spatial_compression
    if plan.vae > 1 and rows % plan.vae:
        raise ParallelPlanError("vae", f"degree {plan.vae} does not divide the {rows} latent rows of height {height}",
                                allowed=f"a height whose latent rows divide by {plan.vae}")


class WanParallel:
    """Checks a plan against a Wan card and builds the parallel ops of an instance."""

    def check_plan(self, card: ModelCard, plan: ParallelPlan) -> None:
        for component_id, spec in card.components.items():
            if spec.kind != "dit":
                continue
            config = WanTransformerConfig.from_diffusers_config(spec.config)
            heads = config.num_attention_heads
            if heads % int(plan.ulysses or 1):
                raise ParallelPlanError(
                    "ulysses", f"degree {plan.ulysses} does not divide the {heads} attention heads of {card.model_id!r} "
                    f"{component_id!r} (Ulysses gives each rank whole heads)",
                    allowed=", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0),
                )
        if plan.vae > 1 and WanVAEConfig.from_diffusers_config(card.components["vae_decoder"].config).is_residual:
            raise ParallelPlanError("vae", f"card {card.model_id!r} has the Wan 2.2 VAE, whose decode is not split", allowed="1")
        defaults = card.capabilities.defaults
        if defaults is not None:
            plan.check_tokens(wan_tokens(card, defaults.frames, defaults.height, defaults.width))
            _check_vae_rows(card, defaults.height, plan)

    def check_request(self, card: ModelCard, request: Request, plan: ParallelPlan) -> None:
        d = request.diffusion
        if d.frames and d.height and d.width:
            plan.check_tokens(wan_tokens(card, d.frames, d.height, d.width))
            _check_vae_rows(card, d.height, plan)

    def build_ops(self, instance: ModelInstance, runtime: ParallelRuntime) -> dict[str, StepOp]:
        compute = instance.options.compute
        if compute is not None and compute.cuda_graphs:
            raise ParallelPlanError("sp", "CUDA graphs (compute.cuda_graphs) are not captured across ranks",
                                    allowed="compute.cuda_graphs false with a parallel plan")
        ops = wan_ops(instance, compute=compute)
        for expert in ("transformer", "transformer_2"):
            if expert in instance.components:
                ops[f"dit_forward:{expert}"] = parallel_dit_op(expert, instance.components[expert], runtime, instance=instance)
        if runtime.plan.vae > 1 and "vae_decoder" in instance.components:
            ops["vae_decode_frame"] = parallel_decode_op(instance.components["vae_decoder"], runtime)
        return ops


    def is_collective(self, op_name: str, plan: ParallelPlan) -> bool:
        """The DiT forwards exchange activations, the VAE decode too under ``vae`` > 1; the encoders run on rank 0."""
        return op_name.startswith("dit_forward:") or (op_name == "vae_decode_frame" and plan.vae > 1)


#: The object cards name: ``fv_wan.parallel:WAN_PARALLEL``.
WAN_PARALLEL = WanParallel()


def _sharded_inputs(inputs: WanBlockInputs, group: Any) -> WanBlockInputs:
    cos, sin = inputs.rotary
    timestep_proj = inputs.timestep_proj
    if timestep_proj.shape[1] > 1:  # per-token timesteps (Wan 2.2 TI2V) split with their tokens
        timestep_proj = shard_sequence(timestep_proj, 1, group)
    return dataclasses.replace(
        inputs, x=shard_sequence(inputs.x, 1, group), timestep_proj=timestep_proj,
        rotary=(shard_sequence(cos, 0, group), shard_sequence(sin, 0, group)),
    )


def _sp_forward(model: WanTransformer, runtime: ParallelRuntime, x: torch.Tensor, t: torch.Tensor,
                context: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
    inputs = model.prepare(x, t, context, image)
    runtime.plan.check_tokens(math.prod(inputs.grid_sizes))
    sp_group = runtime.group("sp")
    local = _sharded_inputs(inputs, sp_group)
    self_attention = SequenceParallelAttention(runtime.group("ulysses"), runtime.group("ring"), model.attention_fn)
    hidden = local.x
    for block in model.blocks:
        hidden = block(hidden, local, model.attention_fn, model.fused_ops, self_attention_fn=self_attention)
    return model.finish(gather_sequence(hidden, 1, sp_group), inputs)


def _gather_rows(mine: torch.Tensor, rows: int, group: Any) -> torch.Tensor:
    """Every rank's round-robin rows back in their original order (rank g had rows g, g+G, ...)."""
    size = dist.get_world_size(group)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine.contiguous(), group=group)
    order = [parts[i % size][i // size] for i in range(rows)]
    return torch.stack(order)


def parallel_dit_op(
    expert: str, model: WanTransformer, runtime: ParallelRuntime, *, instance: ModelInstance | None = None
) -> StepOp:
    """The denoise forward of one rank: its CFG rows, its sequence chunk (each row with its adapters)."""
    cfg_group = runtime.group("cfgp")
    cfg_size, cfg_rank = dist.get_world_size(cfg_group), dist.get_rank(cfg_group)

    def dit_forward(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        x, t, context, image = dit_inputs(model, inputs)
        rows = x.shape[0]
        split = cfg_size > 1 and rows % cfg_size == 0
        mine = list(range(cfg_rank, rows, cfg_size)) if split else list(range(rows))

        def forward(index: list[int]) -> torch.Tensor:
            with rows_adapted(model, adapter_routing(instance, inputs, expert, index)):
                return _sp_forward(model, runtime, x[index], t[index], context[index], None if image is None else image[index])

        if params.get("dispatch", "batched") == "sequential":
            out = torch.cat([forward([i]) for i in mine])
        else:
            out = forward(mine)
        if split:
            out = _gather_rows(out, rows, cfg_group)
        return {"v": out.float()}

    return StepOp(f"dit_forward:{expert}", dit_forward)
