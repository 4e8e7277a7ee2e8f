"""fv-cosmos3: the Cosmos 3 omni model for fv.

Kept import-light on purpose: model code lives in ``fv_cosmos3.models`` and pulls
in torch only when imported.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
