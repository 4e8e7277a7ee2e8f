"""Driven loops: the contract, typed serializable state, the driver, and the policy library.

Names are resolved lazily so that ``fv_kernel.loop.state`` (used by requests and
artifacts) can be imported without pulling in the contract, which imports them.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CancelToken": "fv_kernel.loop.context",
    "LoopContext": "fv_kernel.loop.context",
    "Done": "fv_kernel.loop.contract",
    "Loop": "fv_kernel.loop.contract",
    "LoopResult": "fv_kernel.loop.contract",
    "LoopState": "fv_kernel.loop.contract",
    "StepResult": "fv_kernel.loop.contract",
    "WorkKind": "fv_kernel.loop.contract",
    "WorkPlan": "fv_kernel.loop.contract",
    "drive": "fv_kernel.loop.driver",
    "resume": "fv_kernel.loop.driver",
    "TensorState": "fv_kernel.loop.state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fv_kernel.loop' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
