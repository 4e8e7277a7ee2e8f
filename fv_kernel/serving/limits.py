"""Bounds on a JSON request body, checked before it is parsed.

``json.loads`` recurses once per nesting level (a body nested 100,000 deep raises
``RecursionError``) and turns a 5,000-digit integer into a ``ValueError`` from Python's
int-to-string guard. :func:`parse_json_object` first scans the raw bytes with C-speed
regular expressions and numpy (no recursion, no per-character Python loop): the nesting
depth, the length of every number token and whether every string is closed, and refuses
a body beyond its :class:`JsonLimits` with a 400 naming the bound. Only then does it parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from fv_kernel.config import ServerConfig
from fv_kernel.serving.errors import ApiError

__all__ = ["JsonLimits", "check_json", "parse_json", "parse_json_object"]

# A complete JSON string (escapes included), written as an unrolled loop so the regex engine never backtracks.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_CLOSE = np.zeros(256, dtype=np.int8)
_CLOSE[[ord("]"), ord("}")]] = 1
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# Chunks for the running depth, so a body of brackets never needs a 4-byte counter per byte at once.
_DEPTH_CHUNK = 1 << 20


@dataclass(frozen=True)
class JsonLimits:
    """How deep a JSON body may nest and how long one number in it may be (characters)."""

    max_depth: int
    max_number_chars: int

    @classmethod
    def from_server(cls, server: ServerConfig) -> "JsonLimits":
        return cls(max_depth=server.max_json_depth, max_number_chars=server.max_json_number_chars)


def _max_depth(text: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in ``text`` (strings already removed)."""
    brackets = np.frombuffer(text.translate(None, delete=_NOT_BRACKETS), dtype=np.uint8)
    depth, deepest = 0, 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        chunk = brackets[start : start + _DEPTH_CHUNK]
        steps = _OPEN[chunk].astype(np.int32) - _CLOSE[chunk]
        running = np.cumsum(steps) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest


def check_json(raw: bytes, limits: JsonLimits, *, param: str | None = None) -> None:
    """Refuse ``raw`` (400) if it nests deeper than the limit or holds a longer number token."""
    where = f"{param}: " if param else ""
    # Strings can hold any bracket or digit; what is left outside them is structure and scalars.
    outside = _STRING.sub(b'""', raw)
    if outside.count(b'"') % 2:
        raise ApiError(400, "invalid_json", f"{where}not valid JSON: a string is not closed", param=param)
    if _max_depth(outside) > limits.max_depth:
        raise ApiError(
            400, "invalid_json", f"{where}JSON nested deeper than {limits.max_depth} levels; allowed: <= {limits.max_depth} levels",
            param=param,
        )
    long_number = re.search(rb"[-+0-9.eE]{%d,}" % (limits.max_number_chars + 1), outside)
    if long_number is not None:
        raise ApiError(
            400, "invalid_json",
            f"{where}a JSON number of {len(long_number.group())} characters; allowed: <= {limits.max_number_chars} characters",
            param=param,
        )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_json(raw: bytes | str, limits: JsonLimits, *, param: str | None = None) -> Any:
    """Check ``raw`` against ``limits``, then parse it (``NaN``/``Infinity`` are refused: not JSON)."""
    data = raw.encode() if isinstance(raw, str) else raw
    check_json(data, limits, param=param)
    where = f"{param}: " if param else "the request body is "
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ApiError(400, "invalid_json", f"{where}not valid JSON: {exc}", param=param) from None


def parse_json_object(raw: bytes | str, limits: JsonLimits, *, param: str | None = None) -> dict[str, Any]:
    """:func:`parse_json` of a body that must be a JSON object."""
    data = parse_json(raw, limits, param=param)
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", f"{param + ': ' if param else 'the request body '}must be a JSON object", param=param)
    return data
