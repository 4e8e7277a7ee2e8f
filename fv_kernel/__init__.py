"""fv-kernel: a model-native runtime for video generation, built as a plugin microkernel.

The kernel holds the loop driver, the scheduler, the cache and the parity harness.
Model families, interceptors, transports and integrations are plugins; plugins
import from :mod:`fv_kernel.api` only. Users start with :func:`fv_kernel.load`
(``import fv_kernel as fv; fv.load().generate("a red fox").save("fox.mp4")``).
"""

__version__ = "0.2.0"

#: The distribution that holds the kernel and its built-ins (a plugin id, like any plugin's).
DISTRIBUTION = "fv-kernel"

#: The plugin API version. Plugins declare the range they support in their manifest
#: (``kernel_api``); a plugin outside the range is refused at load.
API_VERSION = "2.13"

#: The Python façade (``fv_kernel.facade``), imported on first use: ``import fv_kernel`` stays
#: light (no torch), so ``fv --help`` and plugin discovery do not pay for the runtime.
_LAZY = {name: "fv_kernel.facade" for name in ("load", "VideoGenerator", "Video", "Finished", "GenerateOptions")}

__all__ = ["API_VERSION", "DISTRIBUTION", "__version__", *_LAZY]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'fv_kernel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
