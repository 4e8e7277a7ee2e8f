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


def drive_loop(instance, loop_id: str, request, upstream: dict | None = None, record: list | None = None):
    """Run one loop of ``instance`` for ``request`` with every plan executed at once (no scheduler).

    Returns (final state, LoopResult); ``record`` collects (plan, outputs) pairs.
    """
    from fv_kernel.api import Done, LoopContext, StepResult, resolve_request

    request = resolve_request(instance.card, request)
    instance.load_for_task(request.task)
    loop = instance.loop(loop_id)

    async def never(plan):  # drive_loop executes plans itself
        raise AssertionError("unused")

    ctx = LoopContext(request=request, executor=never, upstream=dict(upstream or {}))
    state = loop.init(request, instance, ctx)
    while not isinstance(plan := loop.next(state), Done):
        with torch.inference_mode():
            outputs = instance.op(plan.op).fn(plan.inputs, plan.params)
        if record is not None:
            record.append((plan, outputs))
        state = loop.advance(state, StepResult(outputs=outputs))
    return state, loop.finalize(state)
