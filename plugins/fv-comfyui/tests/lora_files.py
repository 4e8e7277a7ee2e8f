"""Tiny LoRA files for fv-wan's tiny cards (inner dim 24, two blocks), written by the tests.

The layouts are the ones ComfyUI users have: ComfyUI / original-Wan names (``diffusion_model.``,
``lora_down``/``lora_up``/``alpha``, as the lightx2v files of the official templates), and
diffusers names for text-encoder weights (``text_encoder.``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

#: fv-wan's tiny transformer: 2 heads x 12 = 24 wide, 2 blocks.
DIM = 24
BLOCKS = 2


def comfy_lora(path: Path, *, seed: int, rank: int = 2, alpha: float = 1.0, amplitude: float = 0.5,
               extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A ComfyUI-format LoRA on every self-attention projection of the tiny transformer."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for block in range(BLOCKS):
        for proj in ("q", "k", "v", "o"):
            key = f"diffusion_model.blocks.{block}.self_attn.{proj}"
            tensors[f"{key}.lora_down.weight"] = amplitude * torch.randn(rank, DIM, generator=generator)
            tensors[f"{key}.lora_up.weight"] = amplitude * torch.randn(DIM, rank, generator=generator)
            tensors[f"{key}.alpha"] = torch.tensor(float(alpha))
    tensors.update(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def text_encoder_weights(seed: int, rank: int = 2, width: int = 32) -> dict[str, torch.Tensor]:
    """diffusers-named text-encoder LoRA entries (``text_encoder.<module>.lora_A/B.weight``)."""
    generator = torch.Generator().manual_seed(seed)
    module = "text_encoder.encoder.block.0.layer.0.SelfAttention.q"  # UMT5's own module names
    return {f"{module}.lora_A.weight": torch.randn(rank, width, generator=generator),
            f"{module}.lora_B.weight": torch.randn(width, rank, generator=generator)}
