"""fv conformance kit: an opt-in pytest plugin (``pytest_plugins = ["fv_kernel.testing"]``).

Install with ``pip install "fv-kernel[testing]"``. It is not auto-loaded into pytest
sessions. Each kit lives in its own module and is re-exported here.
"""

from .plugin_kit import *  # noqa: F401,F403
from .plugin_kit import __all__ as _plugin_kit_all

__all__ = [*_plugin_kit_all]
