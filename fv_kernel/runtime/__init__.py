"""The runtime: the Engine and its scheduler layers, the cost model, admission."""

from fv_kernel.runtime.engine import Engine, GenerationResult, RequestHandle, SchedulerConfig

__all__ = ["Engine", "GenerationResult", "RequestHandle", "SchedulerConfig"]
