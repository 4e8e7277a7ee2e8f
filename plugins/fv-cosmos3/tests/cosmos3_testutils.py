"""Shared helpers for the fv-cosmos3 parity tests.

Parity tolerance for all C0 tests: CPU fp32, max |a - b| <= 1e-5.
"""

from __future__ import annotations

import torch

from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT

ATOL = 1e-5


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"max abs diff {diff:.3e} > {atol:.0e}"


def seeded_state_dict(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for every parameter (norm gains near 1, modality embeds non-zero)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
        is_norm_gain = name.endswith(".weight") and "norm" in name.split(".")[-2]
        out[name] = 1.0 + 0.1 * noise if is_norm_gain else 0.2 * noise
    return out


def build_model(config: Cosmos3Config, seed: int = 0) -> tuple[Cosmos3MoT, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = Cosmos3MoT(config).eval()
    state = seeded_state_dict(model, seed)
    model.load_state_dict(state, strict=True)
    return model, state
