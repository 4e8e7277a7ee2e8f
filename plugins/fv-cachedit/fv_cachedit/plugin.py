"""fv-cachedit's plugin module, registered under the ``fv.plugins`` entry point.

Kept light: the interceptor classes (and torch) are imported only when the host asks.
"""

from __future__ import annotations

from typing import Any

from fv_kernel.api import hookimpl


@hookimpl
def fv_register_interceptors(register: Any) -> None:
    from fv_cachedit.block_cache import DBCache, FBCache, TaylorSeer
    from fv_cachedit.step_cache import StepSkip

    for interceptor in (DBCache, FBCache, TaylorSeer, StepSkip):
        register(interceptor.plugin_id, interceptor)
