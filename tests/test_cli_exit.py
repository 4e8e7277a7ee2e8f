"""The ``fv`` console script's exit (``fv_kernel.cli.app.run``): it skips the interpreter's teardown
(about 0.6 s with torch imported, docs/benchmarks.md) but still does what an exit must: wait for
threads that are not daemons, run ``atexit`` handlers, flush stdout and stderr, and exit with the
command's status (a string status printed to stderr, status 1, as ``sys.exit`` does)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

_SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from fv_kernel.cli import app

def command():
    def late_write():  # a command's worker thread still finishing when the command returns
        time.sleep(0.3)
        Path(sys.argv[1]).write_text("written by a thread")
    threading.Thread(target=late_write).start()
    atexit.register(lambda: print("atexit ran"))
    sys.stdout.write("buffered, no newline")  # stdout is a pipe here: block-buffered
    status = sys.argv[2]
    raise SystemExit(None if status == "none" else int(status) if status.isdigit() else status)

app.main = command
app.run()
"""


def _run(tmp_path: Path, status: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout stays block-buffered
    return subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "late.txt"), status],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(("status", "code"), [("3", 3), ("0", 0), ("none", 0)])
def test_the_exit_waits_for_threads_runs_atexit_and_flushes(tmp_path: Path, status: str, code: int) -> None:
    done = _run(tmp_path, status)
    assert done.returncode == code, done.stderr
    assert (tmp_path / "late.txt").read_text() == "written by a thread"
    assert "buffered, no newline" in done.stdout and "atexit ran" in done.stdout


def test_a_string_status_is_printed_and_exits_1(tmp_path: Path) -> None:
    done = _run(tmp_path, "fv: something went wrong")
    assert done.returncode == 1 and done.stderr.strip() == "fv: something went wrong"


def test_the_console_script_is_run() -> None:
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "fv"]
    assert script.value == "fv_kernel.cli.app:run"
