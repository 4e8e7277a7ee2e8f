"""Driven loops: the step records, the loop contract, the driver, and the policy library
(samplers, guidance, token sampling)."""

from fv_kernel.loop.contract import CancelToken, Done, Loop, LoopContext, LoopResult, LoopState
from fv_kernel.loop.driver import drive, resume
from fv_kernel.loop.plan import StepResult, WorkKind, WorkPlan

__all__ = [
    "CancelToken", "Done", "Loop", "LoopContext", "LoopResult", "LoopState", "StepResult", "WorkKind", "WorkPlan",
    "drive", "resume",
]
