"""Shared fixtures: one wan-tiny engine (from a deploy config, as the worker builds it) per session."""

from __future__ import annotations

import pytest
import torch

from fv_kernel.api import DeployConfig, Engine, build_engine

# Tiny models: intra-op threads only add contention on a shared machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def deploy_config() -> DeployConfig:
    return DeployConfig.model_validate({"cards": ["wan-tiny"]})


@pytest.fixture(scope="session")
def engine(deploy_config: DeployConfig) -> Engine:
    return build_engine(deploy_config)
