"""The plugin docs keep the rule they teach: plugin code imports the kernel only through
``fv_kernel.api`` (test code may also use ``fv_kernel.testing``), and ``fv_kernel.api``
exports every name they import from it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import fv_kernel.api

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "docs" / name for name in ("plugins.md", "cards.md", "extensions.md")]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_IMPORT_LINE = re.compile(r"^\s*(?:from\s+(fv_kernel[\w.]*)\s+import|import\s+(fv_kernel[\w.]*))", re.M)


def python_blocks(markdown: str) -> list[str]:
    return _FENCE.findall(markdown)


def _allowed(module: str) -> bool:
    return module == "fv_kernel.api" or module == "fv_kernel.testing" or module.startswith("fv_kernel.testing.")


def kernel_imports(source: str, *, where: str) -> list[str]:
    """Every violation in one piece of Python: a kernel import outside the allowed modules, or a
    name ``fv_kernel.api`` does not export. Blocks that are signatures rather than code (they do
    not parse) are checked line by line."""
    problems: list[str] = []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        for match in _IMPORT_LINE.finditer(source):
            module = match.group(1) or match.group(2)
            if not _allowed(module):
                problems.append(f"{where}: imports {module}")
        return problems
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "fv_kernel":
            if not _allowed(node.module):
                problems.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif node.module == "fv_kernel.api":
                problems.extend(
                    f"{where}: fv_kernel.api does not export {a.name!r}" for a in node.names if not hasattr(fv_kernel.api, a.name)
                )
        elif isinstance(node, ast.Import):
            problems.extend(
                f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] == "fv_kernel" and not _allowed(a.name)
            )
    return problems


def test_docs_import_the_kernel_only_through_the_api() -> None:
    problems: list[str] = []
    for doc in DOCS:
        for index, block in enumerate(python_blocks(doc.read_text(encoding="utf-8"))):
            problems.extend(kernel_imports(block, where=f"{doc.relative_to(ROOT)} python block {index}"))
    for example in EXAMPLES:
        problems.extend(kernel_imports(example.read_text(encoding="utf-8"), where=str(example.relative_to(ROOT))))
    assert not problems, "\n".join(problems)


def test_the_docs_have_code_to_check() -> None:
    # The check reads what it thinks it reads: each doc has python blocks, and they import the api.
    for doc in DOCS:
        blocks = python_blocks(doc.read_text(encoding="utf-8"))
        assert blocks, f"{doc.name}: no python blocks found"
    assert any("from fv_kernel.api import" in b for b in python_blocks((ROOT / "docs" / "plugins.md").read_text()))
    assert EXAMPLES, "no docs/examples/*.py"


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        ("from fv_kernel.plugins import hookimpl\n", "from fv_kernel.plugins import hookimpl"),
        ("from fv_kernel.loop.samplers import FlowEulerSampler\n", "from fv_kernel.loop.samplers import FlowEulerSampler"),
        ("import fv_kernel.card.spec as spec\n", "import fv_kernel.card.spec"),
        ("from fv_kernel.api import NoSuchThing\n", "does not export 'NoSuchThing'"),
        ("class Loop(Generic[S]):\n    def init(self) -> S  # a signature\nfrom fv_kernel.loop import x\n", "imports fv_kernel.loop"),
    ],
)
def test_the_check_catches_what_it_exists_to_catch(block: str, needle: str) -> None:
    # Negative controls: the mistakes the old tutorial made, and a name the api lacks.
    problems = kernel_imports(block, where="doc")
    assert len(problems) == 1 and needle in problems[0], problems
    doc = f"Text.\n\n```python\n{block}```\n"
    assert python_blocks(doc) == [block]


def test_allowed_imports_pass() -> None:
    ok = "from fv_kernel.api import hookimpl, FlowEulerSampler\nfrom fv_kernel.testing import PluginConformance\nfrom fv_kernel.testing.toy import toy_card\n"
    assert kernel_imports(ok, where="doc") == []
