"""Shared fixtures: tiny instances (toy-dit from the kernel, wan-tiny from fv-wan), one per session."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from cachedit_testutils import any_card

from fv_kernel.model.instance import ModelInstance, build_instance

# Tiny models: intra-op threads only add contention on a shared machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def instance() -> Callable[[str], ModelInstance]:
    """``instance(model_id)``: one resident instance per card for the session (weights are read-only)."""
    built: dict[str, ModelInstance] = {}

    def get(model_id: str) -> ModelInstance:
        if model_id not in built:
            built[model_id] = build_instance(any_card(model_id))
        return built[model_id]

    return get
