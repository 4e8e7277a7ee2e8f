"""Blocking entry points never format their result (fv_kernel/runtime/blocking.py).

``asyncio.run`` keeps a coroutine's value on its main task and, leaving, formats that task with
``%r`` (its SIGINT bookkeeping): a finished video's tensors were formatted on every blocking call.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from fv_kernel.runtime.blocking import run_blocking, run_in_runner

KERNEL = Path(__file__).resolve().parents[1] / "fv_kernel"


class Spy:
    """A result that counts how often it is formatted."""

    def __init__(self) -> None:
        self.formatted = 0

    def __repr__(self) -> str:
        self.formatted += 1
        return "Spy()"


async def _make(spy: Spy) -> list[Spy]:
    await asyncio.sleep(0)
    return [spy]


def test_asyncio_run_formats_the_result_it_keeps() -> None:
    # The negative control: the cost run_blocking exists to remove, on this Python.
    spy = Spy()
    assert asyncio.run(_make(spy)) == [spy]
    if spy.formatted == 0:
        pytest.skip("this Python's asyncio.run does not format its main task's result")


def test_run_blocking_returns_the_value_and_never_formats_it() -> None:
    spy = Spy()
    assert run_blocking(_make(spy)) == [spy]
    with asyncio.Runner() as runner:
        assert run_in_runner(runner, _make(spy)) == [spy]
    assert spy.formatted == 0


def test_run_blocking_raises_what_the_coroutine_raises() -> None:
    async def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        run_blocking(fail())


def test_the_kernel_runs_coroutines_only_through_run_blocking() -> None:
    # Engine.generate, run_local, run_concurrently, the facade and the CLI hand back videos.
    offenders = []
    for path in KERNEL.rglob("*.py"):
        if path.name == "blocking.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"\basyncio\.run\(|\brunner\.run\(", code) and not code.strip().startswith(('"', "``")):
                offenders.append(f"{path.relative_to(KERNEL)}:{number}: {line.strip()}")
    assert offenders == []
