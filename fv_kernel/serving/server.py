"""Run the app under uvicorn: in the foreground (``fv serve``) or on a background thread (tests, benchmarks).

A graceful stop (SIGINT/SIGTERM, or ``ServerThread.stop``) first *drains* the app: every
attached event stream of an unfinished job gets a ``server.shutdown`` event and ends, and
the engine suspends running jobs at their next step boundary (their last checkpoint is
written). Only then does uvicorn wait for the remaining connections, at most
``shutdown_timeout_s``, so open SSE streams never hold a stop for the whole timeout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from fv_kernel.config import ServerConfig

__all__ = ["FvServer", "ServerThread", "serve_forever"]

log = logging.getLogger("fv.serving")

_DEFAULT_SHUTDOWN_TIMEOUT_S: float = ServerConfig.model_fields["shutdown_timeout_s"].default


class FvServer(uvicorn.Server):
    """uvicorn's server, with the app's drain (``app.state.drain``) run first when a stop begins."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if drain is not None:
            # Stop accepting first, so no job is created while the engine stops.
            for server in self.servers:
                server.close()
            try:
                await asyncio.wait_for(drain(), timeout=self.config.timeout_graceful_shutdown)
            except asyncio.TimeoutError:
                log.error("draining the app took over %s s; stopping anyway", self.config.timeout_graceful_shutdown)
            except Exception:  # noqa: BLE001 - a failed drain must not keep the process alive
                log.exception("draining the app failed")
        await super().shutdown(sockets)


def serve_forever(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    shutdown_timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S,
    sockets: list[socket.socket] | None = None,
) -> None:
    """Serve ``app`` until interrupted (SIGINT/SIGTERM stop it gracefully: attached event streams get
    ``server.shutdown``, running jobs are suspended for the next start). ``sockets``: already bound
    listening sockets to serve on instead of ``host``/``port``."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=shutdown_timeout_s,
    )
    FvServer(config).run(sockets=sockets)


class ServerThread:
    """A real uvicorn server on a background thread, bound to a free port before it starts.

    Binding the socket here (port 0) avoids the race of picking a port and binding it later.
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        shutdown_timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S,
    ) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=shutdown_timeout_s)
        self.server = FvServer(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
