"""The ranks of ``fv serve`` with a multi-rank ``parallel:`` plan, when fv starts them itself.

Rank 0 is the serving process; :class:`LocalWorkers` starts ranks 1..N-1 as its children
(each deploys the same config and runs rank 0's decisions), and can restart them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

from fv_kernel.config import DeployConfig
from fv_kernel.deploy.parallel import deploy_parallel
from fv_kernel.parallel.launch import free_port

__all__ = ["LocalWorkers", "serve_as_worker"]


def serve_as_worker(config_json: str) -> None:
    """A worker rank of ``fv serve``: deploy the same config, then run rank 0's decisions until it stops."""
    deploy_parallel(DeployConfig.model_validate_json(config_json)).serve()


def _spawned_worker(rank: int, world_size: int, port: int, config_json: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    serve_as_worker(config_json)


class LocalWorkers:
    """fv's own launcher for ``fv serve``: this process becomes rank 0, ranks 1..N-1 are its children.

    It can also restart them (:meth:`restart`), which is what lets rank 0 recover from a
    dead rank (``SpmdLeader.recover``); torchrun's ranks are not fv's to restart.
    """

    def __init__(self, world_size: int, config_json: str) -> None:
        self.world_size, self.config_json = world_size, config_json
        self.processes: list[Any] = []
        self._start()

    def _start(self) -> None:
        port = free_port()
        os.environ.update(RANK="0", WORLD_SIZE=str(self.world_size), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        context = mp.get_context("spawn")
        self.processes = [
            context.Process(target=_spawned_worker, args=(rank, self.world_size, port, self.config_json), daemon=True,
                            name=f"fv-rank-{rank}")
            for rank in range(1, self.world_size)
        ]
        for process in self.processes:
            process.start()

    def restart(self) -> None:
        """End every worker (a survivor is stuck in the failed collective) and start fresh ones on a new port."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
        self._start()

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the workers (rank 0 has told them to stop); end any still running."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
