"""The conformance kit, run as a third party would: pytest in a subprocess on a generated test file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TEST_FILE = '''
pytest_plugins = ["fv_kernel.testing"]

from fv_kernel.testing import PluginConformance


class TestGood(PluginConformance):
    distribution = "fv-good"
    search_path = [{site!r}]


class TestBad(PluginConformance):
    distribution = "fv-bad"
    search_path = [{site!r}]


def test_fixtures(fv_host, register_plugin, hook_recorder):
    from fv_kernel.plugins import hookimpl

    class P:
        @hookimpl
        def fv_request_finished(self, request_id, status):
            pass

    register_plugin(P(), name="fv-p")
    fv_host.hooks.request_finished("r", "succeeded")
    assert hook_recorder.names() == ["fv_request_finished"]
    assert [p.distribution for p in fv_host.discovered()] == []
'''


def test_kit_passes_good_plugin_and_fails_bad_one_readably(fixture_site: Path, tmp_path: Path) -> None:
    test_file = tmp_path / "test_third_party.py"
    test_file.write_text(TEST_FILE.format(site=str(fixture_site)))
    env = {**os.environ, "PYTHONPATH": str(fixture_site)}
    env.pop("FV_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-q", "-rA", "-p", "no:cacheprovider", "-o", "addopts="],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    for name in (
        "test_entry_point_resolves",
        "test_manifest_validates",
        "test_import_initialises_no_cuda_and_reads_no_weights",
        "test_register_twice_is_harmless",
        "test_contributions_exist_and_satisfy_bases",
    ):
        assert f"PASSED test_third_party.py::TestGood::{name}" in out, out
    assert "PASSED test_third_party.py::test_fixtures" in out
    assert "FAILED test_third_party.py::TestBad::test_contributions_exist_and_satisfy_bases" in out
    assert "FAILED test_third_party.py::TestBad::test_import_initialises_no_cuda_and_reads_no_weights" in out
    assert "PASSED test_third_party.py::TestBad::test_manifest_validates" in out
    # readable: the reasons, not a traceback into the kit
    assert "fv-bad: declared contributions:\n  - " in out
    assert "manifest declares transports 'ghost'" in out
    assert "read weight files" in out and "weights.safetensors" in out
    assert "plugin_kit.py" not in out
