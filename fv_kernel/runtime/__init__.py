"""The runtime: the Engine and its scheduler layers, the cost model, admission."""

from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.records import GenerationResult, RequestHandle
from fv_kernel.runtime.scheduler import SchedulerConfig

__all__ = ["Engine", "GenerationResult", "RequestHandle", "SchedulerConfig"]
