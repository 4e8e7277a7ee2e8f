"""docs/plugins.md's tutorial is the fixture ``fv-hello``, file for file, and it does what the tutorial says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from fv_kernel.cli.app import app

from conftest import FIXTURE_PLUGINS

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "plugins.md"
HELLO = FIXTURE_PLUGINS / "fv-hello"
# A file label line ("`my-plugin/fv_hello/plugin.py` — ...") followed, after prose, by its fenced block.
_LABELLED = re.compile(r"^`my-plugin/([^`]+)`[^\n]*\n(?:(?!```|`my-plugin/)[^\n]*\n)*?```[a-z]*\n(.*?)^```", re.S | re.M)


def tutorial_files(markdown: str) -> dict[str, str]:
    return {path: body for path, body in _LABELLED.findall(markdown)}


def _source_file(path: Path, fixture: Path) -> bool:
    """A file of the plugin's source, not what importing or installing it leaves behind."""
    parts = path.relative_to(fixture).parts
    built = any(part == "__pycache__" or part == "build" or part.endswith(".egg-info") for part in parts)
    return path.is_file() and path.name != "__init__.py" and not built and path.suffix != ".pyc"


def differences(markdown: str, fixture: Path) -> list[str]:
    shown = tutorial_files(markdown)
    problems = [f"{path}: the tutorial's text differs from {fixture.name}/{path}"
                for path, body in shown.items() if not (fixture / path).is_file() or (fixture / path).read_text() != body]
    on_disk = {str(p.relative_to(fixture)) for p in fixture.rglob("*") if _source_file(p, fixture)}
    problems += [f"{path}: in the fixture but not shown in the tutorial" for path in sorted(on_disk - set(shown))]
    return problems


def test_the_tutorial_shows_the_fixture_file_for_file() -> None:
    text = TUTORIAL.read_text(encoding="utf-8")
    assert set(tutorial_files(text)) == {
        "pyproject.toml", "fv_hello/fv-plugin.yaml", "fv_hello/attention.py", "fv_hello/samplers.py", "fv_hello/plugin.py",
        "tests/test_conformance.py",
    }
    assert differences(text, HELLO) == []


def test_import_leftovers_are_not_part_of_the_comparison(tmp_path: Path) -> None:
    copy = tmp_path / "fv-hello"
    shutil.copytree(HELLO, copy)
    (copy / "fv_hello" / "__pycache__").mkdir(exist_ok=True)
    (copy / "fv_hello" / "__pycache__" / "attention.cpython-311.pyc").write_bytes(b"\0")
    (copy / "fv_hello" / "extra.py").write_text("")
    # A stray compiled file is ignored; a real source file the tutorial does not show is not.
    assert differences(TUTORIAL.read_text(encoding="utf-8"), copy) == ["fv_hello/extra.py: in the fixture but not shown in the tutorial"]


def test_the_comparison_catches_a_drifted_tutorial() -> None:
    # Negative control: the tutorial's old import line, which broke the "only fv_kernel.api" rule.
    text = TUTORIAL.read_text(encoding="utf-8")
    drifted = text.replace("from fv_kernel.api import FlowEulerSampler", "from fv_kernel.loop.samplers import FlowEulerSampler")
    assert drifted != text
    assert differences(drifted, HELLO) == ["fv_hello/samplers.py: the tutorial's text differs from fv-hello/fv_hello/samplers.py"]


def test_the_tutorial_plugin_passes_its_conformance_tests(fixture_site: Path, tmp_path: Path) -> None:
    # Step 6, as written: `python -m pytest my-plugin/tests -q` with fv-hello installed.
    plugin_tests = tmp_path / "my-plugin" / "tests"
    shutil.copytree(HELLO / "tests", plugin_tests)  # out of this repository's conftest, as in the user's project
    env = {**os.environ, "PYTHONPATH": str(fixture_site)}
    env.pop("FV_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "my-plugin/tests", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 passed" in done.stdout


def test_fv_plugins_check_passes_it(plugin_site: Path) -> None:
    # Step 4: `fv plugins check fv-hello` ends with the promised line.
    result = CliRunner().invoke(app, ["plugins", "check", "fv-hello", "--no-side-effects"])
    assert result.exit_code == 0 and result.stdout.strip().endswith("fv-hello: all checks passed")


def test_fv_plugins_list_shows_it_as_the_tutorial_says(plugin_site: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("FV_PLUGINS", raising=False)
    result = CliRunner().invoke(app, ["plugins", "list"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    at = lines.index("fv-hello 0.1.0  [enabled]  autoload")
    assert lines[at + 1:at + 3] == ["    attention_backends: fv-hello/hello-math", "    samplers: fv-hello/euler-shift3"]
