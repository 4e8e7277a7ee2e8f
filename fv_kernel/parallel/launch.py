"""fv's own launcher: start ``world_size`` local processes as torchrun would, bounded and cleaned up.

``spawn(target, world_size, args)`` runs ``target(rank, *args)`` in fresh processes (the
``spawn`` start method: no inherited threads or CUDA state) with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, and returns each rank's return value
in rank order. A rank that raises, dies or outlives ``timeout_s`` fails the whole launch
with :class:`LaunchError` after every process it started is ended (by its own pid). A launch
whose rendezvous port another process took first is started again on a new port.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["LaunchError", "free_port", "spawn"]


class LaunchError(RuntimeError):
    """A launched rank failed, died or timed out; carries what each rank reported."""

    def __init__(self, message: str, reports: dict[int, Any]) -> None:
        super().__init__(message)
        self.reports = reports


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child(rank: int, world_size: int, port: int, target: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        value = target(rank, *args)
        results.put((rank, "ok", value))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot always be torn down
                pass


#: How a rank's report says the rendezvous port was taken between ``free_port()`` and rank 0's
#: bind (another process on the machine got it first): the launch is retried on a new port.
_PORT_TAKEN = ("EADDRINUSE", "address already in use")


class _PortTaken(Exception):
    pass


def spawn(target: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 300.0,
          allow_dead: frozenset[int] = frozenset(), port_attempts: int = 3) -> list[Any]:
    """Run ``target(rank, *args)`` on ``world_size`` local processes; their return values by rank.

    ``allow_dead``: ranks that may end without reporting (a test that kills one on purpose).
    A launch whose rendezvous port was taken before rank 0 bound it (``EADDRINUSE``) is ended at
    once and started again on a new port, up to ``port_attempts`` launches in all.
    """
    if port_attempts < 1:
        raise ValueError(f"port_attempts must be at least 1, got {port_attempts}")
    for attempt in range(1, port_attempts + 1):
        try:
            return _spawn_once(target, world_size, args, free_port(), timeout_s, allow_dead)
        except _PortTaken as taken:
            if attempt == port_attempts:
                raise LaunchError(f"the rendezvous port was taken {port_attempts} times in a row: {taken}", {}) from None
    raise AssertionError("unreachable")


def _spawn_once(target: Callable[..., Any], world_size: int, args: tuple, port: int, timeout_s: float,
                allow_dead: frozenset[int]) -> list[Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_child, args=(rank, world_size, port, target, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    reports: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while len(reports) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
                reports[rank] = (status, value)
                if status == "error" and any(sign in str(value) for sign in _PORT_TAKEN):
                    # The other ranks would wait out their connect timeout on a port nobody serves.
                    raise _PortTaken(f"rank {rank} on port {port}: {str(value).splitlines()[0]}")
                continue
            except queue.Empty:
                pass
            dead = {r for r, p in enumerate(processes) if not p.is_alive() and r not in reports}
            if dead and dead <= allow_dead and len(reports) + len(dead) >= world_size:
                time.sleep(0.2)  # let a last report in flight land
                while not results.empty():
                    rank, status, value = results.get_nowait()
                    reports[rank] = (status, value)
                break
            if dead - allow_dead:
                time.sleep(0.5)
                while not results.empty():
                    rank, status, value = results.get_nowait()
                    reports[rank] = (status, value)
                if dead - allow_dead - set(reports):
                    raise LaunchError(f"rank(s) {sorted(dead - allow_dead - set(reports))} exited without a result "
                                      f"(exit codes {[processes[r].exitcode for r in sorted(dead)]})", reports)
            if time.monotonic() > deadline:
                raise LaunchError(f"launch of {world_size} ranks timed out after {timeout_s:.0f} s "
                                  f"(reported: {sorted(reports)})", reports)
        finished = True
    finally:
        for process in processes:
            process.join(timeout=5 if finished else 0.5)  # a failed launch does not wait on a hung rank
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        results.close()
    errors = {rank: value for rank, (status, value) in reports.items() if status == "error"}
    if errors:
        raise LaunchError("; ".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items())), reports)
    return [reports[rank][1] if rank in reports else None for rank in range(world_size)]
