"""docs/extensions.md's worked example runs: every ```python block of the page, in order, as one script."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "extensions.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_worked_example_runs() -> None:
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 5, f"{DOC}: expected the observer, interceptor, plugin, tests and run blocks"
    script = "\n\n".join(blocks)
    module = types.ModuleType("extensions_doc_example")  # dataclasses look their module up in sys.modules
    sys.modules[module.__name__] = module
    try:
        exec(compile(script, str(DOC), "exec", dont_inherit=True), module.__dict__)  # noqa: S102 - the doc's own example
    finally:
        del sys.modules[module.__name__]
    namespace = module.__dict__
    # The run block checked its own results; make sure it ran to the end.
    assert namespace["batch_sizes"] and max(namespace["batch_sizes"]) == 2  # type: ignore[arg-type]
