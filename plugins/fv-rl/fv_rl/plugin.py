"""fv-rl's plugin module, registered under the ``fv.plugins`` entry point.

Kept light: the method classes (and torch) are imported only when the host asks.
"""

from __future__ import annotations

from typing import Any

from fv_kernel.api import hookimpl


@hookimpl
def fv_register_rl_methods(register: Any) -> None:
    from fv_rl.flow_matching import FlowMatching

    register(FlowMatching.name, FlowMatching)
