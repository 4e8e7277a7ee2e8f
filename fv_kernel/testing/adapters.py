"""Tiny LoRA files for tests: a diffusers/PEFT-layout state dict for any module's linears.

:func:`peft_lora_tensors` makes seeded ``lora_A`` / ``lora_B`` (and optional ``.alpha``) tensors
for chosen linears of a module; :func:`write_peft_lora` saves them as a ``.safetensors`` file
with metadata (e.g. ``fv.assumes_steps`` for a distilled adapter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

__all__ = ["peft_lora_tensors", "write_peft_lora"]


def peft_lora_tensors(
    module: nn.Module, component: str, targets: Iterable[str], *, rank: int = 2, alpha: float | None = None,
    seed: int = 0, bias: bool = False, std: float = 0.1,
) -> dict[str, torch.Tensor]:
    """``<component>.<target>.lora_A.weight`` ``[rank, in]`` and ``.lora_B.weight`` ``[out, rank]``
    for each linear ``target`` of ``module`` (seeded normal values; B is not zero, so the adapter
    changes the output), plus ``.alpha`` when given and ``lora_B.bias`` with ``bias``."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for target in targets:
        linear = module.get_submodule(target)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{target} is a {type(linear).__name__}, not a Linear")
        key = f"{component}.{target}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=gen) * std
        tensors[f"{key}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=gen) * std
        if alpha is not None:
            tensors[f"{key}.alpha"] = torch.tensor(float(alpha))
        if bias:
            tensors[f"{key}.lora_B.bias"] = torch.randn(linear.out_features, generator=gen) * std
    return tensors


def write_peft_lora(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> Path:
    """Save ``tensors`` as a safetensors file with ``metadata``; returns the path."""
    from safetensors.torch import save_file

    path = Path(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=dict(metadata or {}))
    return path
