"""fv-dynamo's plugin module (the ``fv.plugins`` entry point).

fv-dynamo contributes no model code: its contribution is the ``fv worker`` command its
manifest declares. The module stays importable without Dynamo installed.
"""

from __future__ import annotations
