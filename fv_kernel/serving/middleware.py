"""Pure-ASGI guards that run before routing: bearer-token auth and the request-body cap."""

from __future__ import annotations

import hmac
import json
from collections import Counter
from typing import Any, Awaitable, Callable, MutableMapping

from fv_kernel.serving.errors import error_body

__all__ = ["AuthMiddleware", "BodyLimitMiddleware", "BodyTooLarge"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _send_error(send: Send, status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(error_type, message)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """With an API key set, every path except the open ones needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, open_paths: frozenset[str], rejections: Counter[str]) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._open = open_paths
        self._rejections = rejections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._key is None or scope.get("path") in self._open:
            await self.app(scope, receive, send)
            return
        supplied = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    supplied = token.strip()
                break
        # Constant-time comparison; an empty token is compared too so timing reveals nothing.
        if not hmac.compare_digest(supplied, self._key):
            self._rejections["authentication"] += 1
            await _send_error(
                send, 401, "authentication_error", "missing or invalid API key: send 'Authorization: Bearer <key>'",
                {"WWW-Authenticate": "Bearer"},
            )
            return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """Raised from ``receive`` when a body without (or with a lying) Content-Length grows past the cap."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit} bytes")
        self.limit = limit


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes``: at once when Content-Length says so, else while reading."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: int, rejections: Counter[str], path_limits: dict[tuple[str, str], int] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._rejections = rejections
        #: (method, path) -> its own cap, e.g. an adapter upload, which is larger than any JSON body.
        self._path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self._path_limits.get((scope.get("method", ""), scope.get("path", "")), self.max_bytes)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_error(send, 400, "invalid_request", "Content-Length is not an integer")
                    return
                if declared > max_bytes:
                    self._rejections["body_too_large"] += 1
                    await _send_error(send, 413, "body_too_large", f"request body exceeds the limit of {max_bytes} bytes")
                    return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise BodyTooLarge(max_bytes)
            return message

        await self.app(scope, counted_receive, send)
