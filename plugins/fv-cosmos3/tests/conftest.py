"""Fixtures: a tiny config and one seeded random state dict shared by every parity test."""

from __future__ import annotations

import pytest
import torch
from cosmos3_testutils import build_model

from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT


@pytest.fixture(scope="session")
def tiny_config() -> Cosmos3Config:
    return Cosmos3Config.tiny()


@pytest.fixture(scope="session")
def tiny_model(tiny_config: Cosmos3Config) -> tuple[Cosmos3MoT, dict[str, torch.Tensor]]:
    return build_model(tiny_config, seed=0)
