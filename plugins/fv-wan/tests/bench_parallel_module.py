"""``bench/bench_parallel.py`` imported as a module, for the tests that call its functions in-process."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[3] / "bench" / "bench_parallel.py"


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_parallel", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
