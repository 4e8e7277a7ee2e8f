"""fv-wan: the Wan 2.1 / 2.2 model family for fv.

Kept import-light on purpose: importing ``fv_wan`` must not import torch, so the
kernel can read plugin metadata cheaply. The models live in :mod:`fv_wan.models`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
