"""``fv realtime-gateway``: vLLM-Omni's realtime WebSocket in front of a Dynamo fleet of fv workers.

Dynamo's HTTP frontend has no WebSocket route, so realtime sessions reach the workers through this
gateway: ``WS /v1/realtime/video`` speaks the protocol ``fv serve`` speaks (docs/realtime.md,
"Realtime API"), and each connection's session goes through a :class:`~fv_dynamo.sessions.SessionRouter`
to the worker that holds it. A chunk comes from the worker as ``video.chunk`` (JSON, the fMP4 in base64)
and leaves here as ``video.chunk_metadata`` followed by one binary frame, as from ``fv serve``. A client
that disconnects ends its session on the worker (the stream is dropped); a worker that dies ends its
sessions with ``error`` (``worker_lost``) and ``session.done``, and the connection closes.

What ``fv serve`` adds beside the WebSocket (the SSE fallback, the ``/realtime`` page) is not served here.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from fv_dynamo.sessions import SessionRouter
from fv_kernel import api

__all__ = ["WS_PATH", "create_gateway", "dynamo_session_router"]

log = logging.getLogger("fv.dynamo.gateway")

#: The realtime protocol's path, as ``fv serve`` serves it.
WS_PATH = api.WS_PATH
#: Opens the gateway's router inside the server's event loop, and closes it at shutdown.
RouterFactory = Callable[[], AbstractAsyncContextManager[SessionRouter]]


class _Connection(api.RealtimeConnection):
    """One client connection: at most one session, its stream pumped from the router to the client."""

    def __init__(self, ws: WebSocket, router: SessionRouter, limits: api.RealtimeLimits) -> None:
        super().__init__(ws, limits)
        self.router = router
        self.session_id: str | None = None
        self.pump: asyncio.Task[None] | None = None

    @property
    def request_id(self) -> str | None:
        return self.session_id

    def closed(self) -> None:
        if self.pump is not None:
            # Dropping the worker's stream ends the session there (Dynamo stops the call's context).
            self.pump.cancel()

    async def handle(self, data: dict[str, Any]) -> None:
        kind = data["type"]
        if kind == "session.start":
            if self.pump is not None:
                raise api.ProtocolError("session_active", "session.start: this connection already has a session; "
                                        "stop it and open a new connection", "type")
            self.pump = asyncio.create_task(self._pump(data))
            return
        if kind == "session.ping" and self.pump is None:
            await self.send({"type": "session.pong", "request_id": None})
            return
        if self.pump is None:
            raise api.ProtocolError("no_session", f"{kind}: no session yet; send session.start first", "type")
        if self.session_id is None:
            raise api.ProtocolError("session_starting", f"{kind}: the session is still starting; send it after "
                                    "video.start", "type")
        await self.send(await self.router.send(self.session_id, data))

    async def _pump(self, start: dict[str, Any]) -> None:
        try:
            async for data in self.router.start(start):
                kind = data.get("type")
                if kind == "video.start" and self.session_id is None:
                    self.session_id = data.get("request_id")
                if kind == "video.chunk":  # back to the WebSocket form: the metadata, then the fMP4 as one binary frame
                    await self.send(*api.chunk_from_json(data))
                else:
                    await self.send(data)
            await self.ws.close(1000)
        except (WebSocketDisconnect, RuntimeError):
            return  # the client went away mid-send; the router's stream is dropped with this task
        except Exception as exc:  # noqa: BLE001 - a malformed worker message ends the connection with a clear event
            log.exception("realtime gateway: session %s failed", self.session_id)
            try:
                await self.send(api.ProtocolError("internal_error", f"{type(exc).__name__}: {exc}").event(self.session_id))
                await self.ws.close(1011)
            except Exception:  # noqa: BLE001 - the client is gone too
                pass


def create_gateway(
    router_factory: RouterFactory, *, api_key: str | None = None, limits: api.RealtimeLimits | None = None,
) -> FastAPI:
    """The gateway app: ``WS /v1/realtime/video`` over the router ``router_factory`` opens at startup, and
    ``GET /health`` (200 while some worker serves sessions, else 503, with the counts).

    ``api_key``: the WebSocket then needs ``Authorization: Bearer <key>`` or ``?api_key=<key>``, as ``fv
    serve``'s does (a handshake without it is refused). ``limits``: only ``max_message_bytes`` is read here;
    each worker checks the rest of a ``session.start`` against its own limits.
    """
    limits = limits or api.RealtimeLimits()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with router_factory() as router:
            app.state.router = router
            yield

    app = FastAPI(title="fv realtime gateway", lifespan=lifespan)

    @app.get("/health")
    async def health() -> JSONResponse:
        router: SessionRouter = app.state.router
        workers = len(router.client.instance_ids())
        body = {"status": "ok" if workers else "no_workers", "workers": workers, "sessions": len(router.placement)}
        return JSONResponse(body, status_code=200 if workers else 503)

    @app.websocket(WS_PATH)
    async def realtime_video(ws: WebSocket) -> None:
        if not api.realtime_authorized(api_key, ws.headers, ws.query_params):
            await ws.close(code=1008, reason="missing or invalid API key")
            return
        await ws.accept()
        await _Connection(ws, app.state.router, limits).run()

    return app


def dynamo_session_router(runtime: Any, namespace: str, component: str) -> RouterFactory:
    """A router factory over the ``realtime`` endpoint of ``<namespace>.<component>`` in Dynamo's ``runtime``.

    It does not wait for a worker: until one serves the endpoint, ``/health`` says ``no_workers`` and a
    ``session.start`` gets the ``no_workers`` error.
    """

    @asynccontextmanager
    async def open_router() -> AsyncIterator[SessionRouter]:
        client = await runtime.endpoint(f"{namespace}.{component}.realtime").client()
        yield SessionRouter(client)

    return open_router


def serve_gateway(namespace: str, component: str, host: str, port: int, api_key: str | None) -> int:
    """Run the gateway until SIGTERM/SIGINT; the process exit code."""
    try:
        import uvicorn
        from dynamo.runtime import dynamo_worker
    except ImportError:
        print("fv realtime-gateway: NVIDIA Dynamo is not installed (see plugins/fv-dynamo/README.md: Install)",
              file=sys.stderr)
        return 2

    @dynamo_worker()
    async def entry(runtime: Any) -> None:
        app = create_gateway(dynamo_session_router(runtime, namespace, component), api_key=api_key)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        print(f"fv realtime gateway: ws://{host}:{port}{WS_PATH} -> {namespace}.{component}.realtime", flush=True)
        await server.serve()

    asyncio.run(entry())
    return 0
