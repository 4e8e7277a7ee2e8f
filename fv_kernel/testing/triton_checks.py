"""Triton kernel checks that run on the GPU, or on the CPU under Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when ``triton.language`` is first imported (torch does that
as a side effect), so a CPU check runs the test file itself as a fresh Python with the variable
set from the start; the file's ``__main__`` prints its results as JSON on its last line.
:func:`compile_for_sm90` builds a kernel for an H100/H200 on the CPU (no GPU), for checks of
the code Triton generates (tensor-core instructions, vector widths, register spills).
``FV_REQUIRE_TRITON_KERNELS=1`` (the tox envs that install triton) turns the skip without
triton into a failure, so CI cannot pass with the kernels untested.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

__all__ = ["REQUIRE_KERNELS", "Sm90Build", "compile_for_sm90", "run_kernel_checks"]

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


@dataclass(frozen=True)
class Sm90Build:
    """A kernel built for sm_90: its PTX and the bytes ptxas reports spilled (stores + loads)."""

    ptx: str
    spill_bytes: int


def compile_for_sm90(
    kernel: Any, values: dict[str, Any], constexprs: dict[str, Any], *, num_warps: int = 4, num_stages: int = 3,
) -> Sm90Build:
    """Compile the ``@triton.jit`` ``kernel`` for sm_90 with Triton's compiler and its wheel's ptxas.

    Specialised as Triton's JIT specialises a launch: ``values`` gives each runtime argument as a
    type string (``"*bf16"``: a pointer, marked 16-byte aligned; ``"fp32"``) or an int (1 becomes
    a constant, multiples of 16 are marked divisible by 16, others are plain ``i32``);
    ``constexprs`` the constexpr arguments. Skips under ``TRITON_INTERPRET=1``, where nothing compiles.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: nothing is compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, name in enumerate(kernel.arg_names):
        value = values.get(name)
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(value, str):
            signature[name] = value
            attrs[(index,)] = [["tt.divisibility", 16]] if value.startswith("*") else []
        elif value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        elif isinstance(value, int):
            signature[name] = "i32"
            attrs[(index,)] = [["tt.divisibility", 16]] if value % 16 == 0 else []
        else:
            raise ValueError(f"values[{name!r}] must be a type string or an int, got {value!r}")
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx = compiled.asm["ptx"]
    arch = re.search(r"\.target (\S+)", ptx)
    assert arch is not None, "no .target in the PTX"
    report = subprocess.run(
        [triton.knobs.nvidia.ptxas.path, f"-arch={arch.group(1)}", "-v", "-", "-o", "/dev/null"], input=ptx,
        capture_output=True, text=True, check=True,
    ).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills is not None, report
    return Sm90Build(ptx=ptx, spill_bytes=int(spills.group(1)) + int(spills.group(2)))
