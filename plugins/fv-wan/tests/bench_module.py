"""A script under ``bench/`` imported as a module, for the tests that call its functions in-process."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"
#: bench/bench_parallel.py, which most of these tests load.
BENCH = BENCH_DIR / "bench_parallel.py"


def load_bench(name: str = "bench_parallel") -> Any:
    """``bench/<name>.py`` as a fresh module."""
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
