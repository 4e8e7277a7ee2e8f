"""Running the real ``fv serve`` as a process in a test: the entry script that keeps each job's
final frames beside its MP4 (for bit-exact comparisons), and the wait for the server to come up."""

from __future__ import annotations

import contextlib
import subprocess
import time

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
