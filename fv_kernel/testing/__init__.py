"""fv conformance kit: an opt-in pytest plugin (``pytest_plugins = ["fv_kernel.testing"]``).

Install with ``pip install ".[testing]"`` in the fv checkout (fv is on no package index). It is not auto-loaded into pytest
sessions. Each kit lives in its own module and is re-exported here:

- :mod:`.plugin_kit`: the plugin host fixtures and :class:`PluginConformance`;
- :mod:`.card_kit`: :class:`CardConformance` and the gate's requests (:func:`sample_requests`);
- :mod:`.interleave_kit`: the interleave gate, :class:`InterleaveConformance` (exact and throughput batching);
- :mod:`.batching`: staggered arrivals and the check that mid-trajectory requests batch;
- :mod:`.admission`: the check that a loop's estimate prices the steps it runs;
- :mod:`.resume_kit`: :class:`ResumeConformance`, every loop checkpointed and resumed in a fresh process;
- :mod:`.serving`: following an ``fv serve`` job over HTTP (status, progress events);
- :mod:`.toy`: tiny pure-torch cards used as fixtures and examples;
- :mod:`.triton_checks`: a Triton kernel check on CUDA, or on the CPU under Triton's interpreter
  (imported from its module: it needs pytest and torch).

PYTEST_DONT_REWRITE: this package is usually imported by the test module that
declares it in ``pytest_plugins``, i.e. before pytest could rewrite it.
"""

from .admission import *  # noqa: F401,F403
from .admission import __all__ as _admission_all
from .batching import *  # noqa: F401,F403
from .batching import __all__ as _batching_all
from .card_kit import *  # noqa: F401,F403
from .card_kit import __all__ as _card_kit_all
from .interleave_kit import *  # noqa: F401,F403
from .interleave_kit import __all__ as _interleave_kit_all
from .plugin_kit import *  # noqa: F401,F403
from .plugin_kit import __all__ as _plugin_kit_all
from .resume_kit import *  # noqa: F401,F403
from .resume_kit import __all__ as _resume_kit_all
from .serving import *  # noqa: F401,F403
from .serving import __all__ as _serving_all

__all__ = [*_plugin_kit_all, *_card_kit_all, *_interleave_kit_all, *_batching_all, *_resume_kit_all, *_admission_all, *_serving_all]
