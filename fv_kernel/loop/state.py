"""Typed, serializable per-request state.

Everything a loop needs between steps lives in a :class:`TensorState` subclass:
tensors, counters, RNG state, sampler history and interceptor state. Nothing is
kept in module globals or on ``nn.Module`` attributes, so two requests that share
one model instance cannot see each other's state, and a half-finished loop can be
saved in one process and resumed in another.

Serialization goes through ``torch.save`` / ``torch.load(weights_only=True)``:
tensors are stored bit-exactly and loading never executes pickled code.
"""

from __future__ import annotations

import io
import pickle
import sys
import os
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["TensorState", "StateFormatError", "generator_from_state", "new_generator_state"]

T = TypeVar("T", bound="TensorState")

_FORMAT = "fv.tensor_state/1"


class StateFormatError(ValueError):
    """A serialized state could not be read back as the requested type."""


_TYPE_KEY = "__state_type__"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _to_plain(value: Any, *, top: bool = True) -> Any:
    """Recursively turn nested states into plain containers, keeping tensors as they are.

    Nested states record their concrete type, so a field declared as a base state
    (e.g. ``SamplerState``) reads back as the subclass it held (e.g. ``UniPCState``).
    """
    if isinstance(value, TensorState):
        plain = {name: _to_plain(getattr(value, name), top=False) for name in type(value).model_fields}
        if not top:
            plain[_TYPE_KEY] = _qualified(type(value))
        return plain
    if isinstance(value, BaseModel):
        return value.model_dump(mode="python")
    if isinstance(value, dict):
        return {k: _to_plain(v, top=False) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, top=False) for v in value]
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
        buffer = io.BytesIO()
        torch.save(self._payload(), buffer)
        return buffer.getvalue()

    def save(self, path: str | os.PathLike[str]) -> None:
        torch.save(self._payload(), os.fspath(path))

    def _payload(self) -> dict[str, Any]:
        cls = type(self)
        return {
            "format": _FORMAT,
            "type": f"{cls.__module__}:{cls.__qualname__}",
            "state_version": cls.state_version,
            "data": self.to_dict(),
        }

    @classmethod
    def from_bytes(cls: type[T], data: bytes) -> T:
        return cls._from_payload(_read(io.BytesIO(data)))

    @classmethod
    def load(cls: type[T], path: str | os.PathLike[str]) -> T:
        return cls._from_payload(_read(os.fspath(path)))

    @classmethod
    def _from_payload(cls: type[T], payload: Any) -> T:
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise StateFormatError(f"not an fv state (expected format {_FORMAT!r})")
        expected = f"{cls.__module__}:{cls.__qualname__}"
        if payload["type"] != expected:
            raise StateFormatError(f"state was saved as {payload['type']}, cannot load it as {expected}")
        if payload["state_version"] != cls.state_version:
            raise StateFormatError(
                f"{expected} state_version {payload['state_version']} cannot be loaded by version {cls.state_version}"
            )
        return cls.model_validate(payload["data"])


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
