"""Structured API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, with a 4xx
status for anything the caller did.

``type`` names the error precisely (``unknown_field``, ``queue_full``, ...); ``code`` carries
the same identifier, because OpenAI clients expose ``code`` (``openai.APIStatusError.code``)
as the machine-readable reason while OpenAI's own ``type`` is only a category.
"""

from __future__ import annotations

from typing import Any, Mapping

from fv_kernel.errors import FvError, QueueFull, UnknownModel

__all__ = ["ApiError", "error_body", "from_fv_error", "from_validation_errors"]


class ApiError(Exception):
    """An HTTP refusal with a machine-readable type and the offending parameter."""

    def __init__(
        self,
        status: int,
        error_type: str,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.error_type, self.message, self.param)


def error_body(error_type: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": error_type}}


def from_fv_error(exc: FvError) -> ApiError:
    """Map a kernel error raised while validating or submitting a request to its HTTP status."""
    info = exc.info()
    if isinstance(exc, QueueFull):
        retry = max(1, int(round(exc.retry_after_s)))
        return ApiError(429, info["type"], info["message"], param=info["param"], headers={"Retry-After": str(retry)})
    status = 404 if isinstance(exc, UnknownModel) else 400
    return ApiError(status, info["type"], info["message"], param=info["param"])


def _loc_to_param(loc: tuple[Any, ...], prefix: str | None = None) -> str:
    # FastAPI prefixes locations with "body"/"query"/"path"; the API caller knows only field names.
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    if prefix:
        parts.insert(0, prefix)
    return ".".join(parts) or (prefix or "body")


def from_validation_errors(errors: list[Any], *, prefix: str | None = None) -> ApiError:
    """The first pydantic error as a 400 naming the field (an unknown field is named as such)."""
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())), prefix)
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return ApiError(400, "unknown_field", f"{param}: unknown field", param=param)
    message = str(first.get("msg", "invalid value"))
    return ApiError(400, "invalid_request", f"{param}: {message}", param=param)
