"""fv-kernel: a model-native runtime for video generation, built as a plugin microkernel.

The kernel holds the loop driver, the scheduler, the cache and the parity harness.
Model families, interceptors, transports and integrations are plugins; plugins
import from :mod:`fv_kernel.api` only.
"""

__version__ = "0.2.0"

#: The plugin API version. Plugins declare the range they support in their manifest
#: (``kernel_api``); a plugin outside the range is refused at load.
API_VERSION = "2.0"

__all__ = ["API_VERSION", "__version__"]
