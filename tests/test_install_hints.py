"""fv is on no package index: no message or doc may tell a user to ``pip install fv-…`` by name
(that fails with "No matching distribution"); each says how to install from the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: ``pip install fv-kernel``, ``pip install 'fv-kernel[serve]'``, ``pip install "fv-wan"``...
INDEX_INSTALL = re.compile(r"""pip install\s+(?:-\S+\s+)*['"]?fv-[a-z0-9]""")


def sources() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "fv_kernel").rglob("*.py"))]
    for plugin in sorted((ROOT / "plugins").iterdir()):
        found += [*plugin.glob("*.md"), *sorted(plugin.rglob("*.py"))]
    return [p for p in found if "tests" not in p.relative_to(ROOT).parts]


def index_installs(text: str) -> list[str]:
    return [m.group(0) for m in INDEX_INSTALL.finditer(text)]


def test_no_message_or_doc_installs_fv_from_an_index() -> None:
    offenders = {str(p.relative_to(ROOT)): hits for p in sources() if (hits := index_installs(p.read_text(encoding="utf-8")))}
    assert offenders == {}


def test_negative_control_the_old_hints_are_flagged() -> None:
    old = ["error: fv serve needs the serve extra (pip install 'fv-kernel[serve]')", "e.g. 'pip install fv-wan'",
           'pip install "fv-kernel[testing]"', "pip install -q fv-cosmos3"]
    assert all(index_installs(line) for line in old)
    assert not index_installs("""pip install ".[media,serve]" ./plugins/fv-wan""")
