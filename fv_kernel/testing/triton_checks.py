"""Triton kernel checks that run on the GPU, or on the CPU under Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when ``triton.language`` is first imported (torch does that
as a side effect), so a CPU check runs the test file itself as a fresh Python with the variable
set from the start; the file's ``__main__`` prints its results as JSON on its last line.
``FV_REQUIRE_TRITON_KERNELS=1`` (the tox envs that install triton) turns the skip without
triton into a failure, so CI cannot pass with the kernels untested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch

__all__ = ["REQUIRE_KERNELS", "run_kernel_checks"]

REQUIRE_KERNELS = os.environ.get("FV_REQUIRE_TRITON_KERNELS") == "1"


def run_kernel_checks(script: str, on_cuda: Callable[[], dict[str, Any]], *, what: str, timeout_s: float = 600) -> dict[str, Any]:
    """``on_cuda()`` when CUDA is there; otherwise ``script``'s results under ``TRITON_INTERPRET=1``.

    Skips (or, with ``FV_REQUIRE_TRITON_KERNELS=1``, fails) when triton is not importable;
    ``what`` names the kernels in that message.
    """
    from fv_kernel.compute.fused import triton_available

    if not triton_available():
        if REQUIRE_KERNELS:
            pytest.fail(f"FV_REQUIRE_TRITON_KERNELS=1 but triton is not importable: {what} would not be tested")
        pytest.skip("needs triton (on CUDA, or on CPU through its interpreter)")
    if torch.cuda.is_available():
        return on_cuda()
    proc = subprocess.run(
        [sys.executable, script], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
