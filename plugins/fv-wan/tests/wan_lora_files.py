"""Tiny Wan LoRA files for tests: seeded updates of a built transformer (and text encoder), saved
as ``.safetensors`` in the original-Wan (``diffusion_model.`` + ``lora_down``/``lora_up``/``alpha``)
or diffusers (``transformer.`` / ``text_encoder.`` + ``lora_A``/``lora_B``) layout, and a deployment
registry holding them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from fv_kernel.api import AdapterRegistry, AdapterSettings, ModelInstance
from fv_wan.lora import convert_wan_lora

__all__ = ["write_wan_lora", "wan_registry"]

#: original Wan name -> diffusers name of each block linear (written out, not taken from fv_wan).
_BLOCK_LINEARS = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v", "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0",
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}  # fmt: skip


def write_wan_lora(
    path: Path, transformer: nn.Module, *, layout: str = "original", seed: int = 0, rank: int = 2, std: float = 0.3,
    text_encoder: nn.Module | None = None, metadata: dict[str, str] | None = None,
) -> Path:
    """A LoRA on every block linear of ``transformer`` (and the self-attention q/v of every
    ``text_encoder`` block, diffusers layout, when given)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    blocks = len(transformer.blocks)  # type: ignore[arg-type]
    for index in range(blocks):
        for original, diffusers_name in _BLOCK_LINEARS.items():
            linear = transformer.get_submodule(f"blocks.{index}.{diffusers_name}")
            down = torch.randn(rank, linear.in_features, generator=generator) * std
            up = torch.randn(linear.out_features, rank, generator=generator) * std
            if layout == "original":
                stem = f"diffusion_model.blocks.{index}.{original}"
                tensors[f"{stem}.lora_down.weight"], tensors[f"{stem}.lora_up.weight"] = down, up
                tensors[f"{stem}.alpha"] = torch.tensor(float(rank))
            else:
                stem = f"transformer.blocks.{index}.{diffusers_name}"
                tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = down, up
    if text_encoder is not None:
        for name, module in text_encoder.model.named_modules():  # type: ignore[union-attr]
            if isinstance(module, nn.Linear) and name.endswith(("SelfAttention.q", "SelfAttention.v")):
                tensors[f"text_encoder.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * std
                tensors[f"text_encoder.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * std
    save_file(tensors, str(path), metadata=metadata)
    return path


def wan_registry(instance: ModelInstance, folder: Path, *, max_stack: int = 2) -> AdapterRegistry:
    """A registry with ``style`` (original layout, transformer), ``sketch`` (diffusers layout,
    transformer and text encoder) and ``ink`` (original layout, another seed)."""
    registry = AdapterRegistry(convert_wan_lora, AdapterSettings(max_stack=max_stack))
    transformer = instance.component("transformer")
    registry.add_file(write_wan_lora(folder / "style.safetensors", transformer, seed=1))
    registry.add_file(write_wan_lora(folder / "sketch.safetensors", transformer, layout="diffusers", seed=2,
                                     text_encoder=instance.component("text_encoder")))
    registry.add_file(write_wan_lora(folder / "ink.safetensors", transformer, seed=3))
    return registry
