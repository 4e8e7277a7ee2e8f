"""Typed, serializable per-request state.

Everything a loop needs between steps lives in a :class:`TensorState` subclass:
tensors, counters, RNG state, sampler history and interceptor state. Nothing is
kept in module globals or on ``nn.Module`` attributes, so two requests that share
one model instance cannot see each other's state, and a half-finished loop can be
saved in one process and resumed in another.

Serialization goes through ``torch.save`` / ``torch.load(weights_only=True)``:
tensors are stored bit-exactly and loading never executes pickled code. A state may
hold tensors, numbers, strings, bytes, ``None``, enums (stored as their value: a typed
field reads the enum back), pydantic models and lists/tuples/sets/dicts of those.
Anything else (a ``torch.Generator``, a module, a generator, a lambda, an arbitrary
object) is refused when the state is *written* (:class:`StateNotSerializable`, naming
the state, its loop and the field path), not discovered later when it cannot be read.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from enum import Enum
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from fv_kernel.errors import FvError

__all__ = ["TensorState", "StateFormatError", "StateNotSerializable", "generator_from_state", "new_generator_state"]

T = TypeVar("T", bound="TensorState")

_FORMAT = "fv.tensor_state/1"


class StateFormatError(FvError, ValueError):
    """A serialized state could not be read back as the requested type."""

    error_type = "state_format"


class StateNotSerializable(FvError, TypeError):
    """A state holds a value that ``torch.load(weights_only=True)`` could not read back.

    Raised when the state is written; ``param`` is the field path (e.g.
    ``plugin_state['x']['cond']``) and the message names the state type and its loop.
    """

    error_type = "state_not_serializable"


_TYPE_KEY = "__state_type__"

#: Leaf values ``torch.load(weights_only=True)`` reads back as they were written.
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _type_name(value: Any) -> str:
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    if cls.__module__.split(".")[0] == "torch":
        return f"torch.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain_key(key: Any) -> bool:
    if isinstance(key, tuple):
        return all(_plain_key(k) for k in key)
    return isinstance(key, (str, int, float, bool, bytes, type(None)))


class _Unserializable(Exception):
    def __init__(self, path: str, value: Any) -> None:
        super().__init__(path)
        self.path = path
        self.value = value


def _to_plain(value: Any, *, top: bool = True, path: str = "", strict: bool = False) -> Any:
    """Recursively turn nested states and models into plain containers, keeping tensors as they are.

    Nested states record their concrete type, so a field declared as a base state
    (e.g. ``SamplerState``) reads back as the subclass it held (e.g. ``UniPCState``).
    Enums become their value and frozensets sets (``weights_only`` loading reads
    neither); with ``strict`` any other value it could not read raises ``_Unserializable``.
    """
    if isinstance(value, TensorState):
        plain = {
            name: _to_plain(getattr(value, name), top=False, path=f"{path}.{name}", strict=strict)
            for name in type(value).model_fields
        }
        if not top:
            plain[_TYPE_KEY] = _qualified(type(value))
        return plain
    if isinstance(value, BaseModel):
        fields = {name: getattr(value, name) for name in type(value).model_fields}
        fields.update(value.__pydantic_extra__ or {})  # a model that allows extra fields keeps them
        return {name: _to_plain(item, top=False, path=f"{path}.{name}", strict=strict) for name, item in fields.items()}
    if isinstance(value, torch.Tensor):
        if strict and type(value) not in _TENSOR_TYPES:
            raise _Unserializable(path, value)
        return value
    if isinstance(value, Enum):
        return _to_plain(value.value, top=False, path=path, strict=strict)
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, dict):
        plain_dict = {}
        for key, item in value.items():
            if strict and not _plain_key(key):
                raise _Unserializable(f"{path} key {key!r}", key)
            plain_dict[key] = _to_plain(item, top=False, path=f"{path}[{key!r}]", strict=strict)
        return plain_dict
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, top=False, path=f"{path}[{i}]", strict=strict) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return {_to_plain(v, top=False, path=f"{path}{{{v!r}}}", strict=strict) for v in value}
    if strict and not isinstance(value, _PLAIN_LEAVES):
        raise _Unserializable(path, value)
    return value


class TensorState(BaseModel):
    """Base class of every typed state that may hold tensors.

    Subclasses declare typed fields (``torch.Tensor`` is allowed). Unknown fields
    are rejected, so a typo in a loop's ``advance`` is an error, not a silent new
    attribute.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    #: Bumped by a subclass when its field layout changes incompatibly.
    state_version: ClassVar[int] = 1

    @model_validator(mode="wrap")
    @classmethod
    def _concrete_type(cls, data: Any, handler: Any) -> Any:
        # Only already-imported subclasses of the declared type are accepted: state
        # bytes are data and must never make us import arbitrary modules.
        if isinstance(data, dict) and _TYPE_KEY in data:
            data = dict(data)
            name = data.pop(_TYPE_KEY)
            if name != _qualified(cls):
                module_name, _, qualname = str(name).partition(":")
                module = sys.modules.get(module_name)
                target = getattr(module, qualname, None) if module is not None and "." not in qualname else None
                if not (isinstance(target, type) and issubclass(target, cls)):
                    raise ValueError(f"state type {name!r} is not a loaded subclass of {_qualified(cls)}")
                return target.model_validate(data)
        return handler(data)

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict of this state (tensors kept, not copied)."""
        return _to_plain(self)

    def to_bytes(self) -> bytes:
        """The state as bytes that :meth:`from_bytes` reads back bit-exactly (raises :class:`StateNotSerializable`)."""
        buffer = io.BytesIO()
        torch.save(self._payload(), buffer)
        return buffer.getvalue()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_bytes` to ``path`` (raises :class:`StateNotSerializable` before opening the file)."""
        payload = self._payload()
        torch.save(payload, os.fspath(path))

    def _payload(self) -> dict[str, Any]:
        """The plain, checked dict ``torch.save`` writes; every value can be read with ``weights_only``."""
        cls = type(self)
        try:
            data = _to_plain(self, strict=True)
        except _Unserializable as exc:
            where = cls.__name__ + exc.path
            loop_id = getattr(self, "loop_id", None)
            owner = f" (loop {loop_id!r})" if isinstance(loop_id, str) and loop_id else ""
            raise StateNotSerializable(
                f"{where}{owner}: {_type_name(exc.value)} is not serializable; a state holds tensors, numbers, "
                "strings, bytes, None, enums and lists/tuples/sets/dicts of them (keep an RNG as its state "
                "tensor, see new_generator_state)",
                param=exc.path.lstrip("."),
            ) from None
        return {
            "format": _FORMAT,
            "type": f"{cls.__module__}:{cls.__qualname__}",
            "state_version": cls.state_version,
            "data": data,
        }

    @classmethod
    def from_bytes(cls: type[T], data: bytes) -> T:
        return cls.from_payload(_read(io.BytesIO(data)))

    @classmethod
    def load(cls: type[T], path: str | os.PathLike[str]) -> T:
        return cls.from_payload(_read(os.fspath(path)))

    def to_payload(self) -> dict[str, Any]:
        """The checked plain dict :meth:`to_bytes` writes (for embedding one state in another record)."""
        return self._payload()

    @classmethod
    def from_payload(cls: type[T], payload: Any) -> T:
        """Read back a :meth:`to_payload` dict; a wrong type, version or layout is a :class:`StateFormatError`."""
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise StateFormatError(f"not an fv state (expected format {_FORMAT!r})")
        expected = f"{cls.__module__}:{cls.__qualname__}"
        if payload.get("type") != expected:
            raise StateFormatError(f"state was saved as {payload.get('type')}, cannot load it as {expected}")
        if payload.get("state_version") != cls.state_version:
            raise StateFormatError(
                f"{expected} state_version {payload.get('state_version')} cannot be loaded by version {cls.state_version}"
            )
        try:
            return cls.model_validate(payload.get("data"))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(root)"
            raise StateFormatError(f"{expected} data does not fit its fields: {where}: {first['msg']}") from None


def _read(source: Any) -> Any:
    try:
        return torch.load(source, weights_only=True)
    except (RuntimeError, EOFError, ValueError, OSError, pickle.UnpicklingError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise StateFormatError(f"not a readable fv state: {type(exc).__name__}") from None


def new_generator_state(seed: int) -> torch.Tensor:
    """The RNG state of a CPU generator seeded with ``seed``, as a tensor a state can hold."""
    return torch.Generator(device="cpu").manual_seed(int(seed)).get_state()


def generator_from_state(state: torch.Tensor) -> torch.Generator:
    """A CPU generator restored from a state tensor (advance the state by saving ``get_state()`` back)."""
    generator = torch.Generator(device="cpu")
    generator.set_state(state.clone())
    return generator
