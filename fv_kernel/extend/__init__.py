"""Extensions: read-only observers and compute-altering interceptors (design §11)."""

from fv_kernel.extend.interceptors import Interceptor, InterceptorClass
from fv_kernel.extend.observers import Observer, StepRecord

__all__ = ["Interceptor", "InterceptorClass", "Observer", "StepRecord"]
