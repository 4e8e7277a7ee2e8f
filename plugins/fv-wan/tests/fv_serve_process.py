"""Running the real ``fv serve`` as a process in a test: the entry script that keeps each job's
final frames beside its MP4 (for bit-exact comparisons), the wait for the server to come up, and
the server's whole life (start, wait, stop)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Iterator

import httpx

#: ``python -c KEEP_FRAMES_FV serve ...`` (or the same text written to a file) is the fv CLI plus
#: one hook: the final frames are saved as ``frames.pt`` next to the job's files.
#: ``FV_TEST_THREADS`` sets torch's thread count (CPU results depend on it).
KEEP_FRAMES_FV = """
import os, sys, torch
import fv_kernel.serving.jobs as jobs
original = jobs.write_job_files

def write_and_keep_frames(artifact, folder):
    variants = original(artifact, folder)
    torch.save(artifact.frames, folder / "frames.pt")
    return variants

jobs.write_job_files = write_and_keep_frames
if "FV_TEST_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["FV_TEST_THREADS"]))
if __name__ == "__main__":  # fv's spawn re-imports the main module in its ranks, as the fv script allows
    from fv_kernel.cli.app import main
    sys.argv[0] = "fv"
    main()
"""


def wait_until_healthy(process: subprocess.Popen[bytes], client: httpx.Client, timeout_s: float) -> None:
    """Poll ``/health`` until it answers 200; fail with the server's stderr if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise AssertionError(f"fv serve exited: {process.stderr.read().decode()[-3000:]}")  # type: ignore[union-attr]
        with contextlib.suppress(httpx.TransportError):
            if client.get("/health").status_code == 200:
                return
        assert time.monotonic() < deadline, "fv serve did not come up"
        time.sleep(0.2)


@contextlib.contextmanager
def serving_process(
    command: list[str], env: dict[str, str], port: int, *, healthy_timeout_s: float
) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client]]:
    """``fv serve`` started as ``command`` (listening on ``port``) in a session of its own; yields it and
    a client once ``/health`` answers. On exit it is stopped as Ctrl-C stops it, and its whole session
    (the server and any ranks it started) is killed if it has not exited within 60 s."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client:
            wait_until_healthy(process, client, timeout_s=healthy_timeout_s)
            yield process, client
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)
