"""The one table of contribution kinds: their abstract base, shape and source.

Bases are referenced by import string and imported only when a contribution of
that kind is checked, so the table costs nothing at import and tolerates planes
that a given deployment never touches.
"""

from __future__ import annotations

import importlib
from enum import Enum
from types import MappingProxyType
from typing import Mapping

from pydantic import BaseModel, ConfigDict

from .errors import DriverTypeError, PluginError


class Shape(str, Enum):
    """Whether a contribution is an instance of its base or a subclass of it."""

    INSTANCE = "instance"
    CLASS = "class"


class KindSpec(BaseModel):
    """One row of the kinds table."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    base: str
    """``"module:attr"`` of the abstract base every contribution must satisfy."""
    shape: Shape
    hook: str | None
    """Registration hook name, or None when the kind comes only from its driver group."""
    name_attr: str | None = None
    """The contribution's own name attribute (``model_id``, ``name``): it must equal the name it is
    registered under, because lookups by that name (a request's model, a sampler state) must find it."""

    @property
    def entry_point_group(self) -> str:
        """The per-kind named-driver entry-point group, ``fv.<kind>``."""
        return f"fv.{self.kind}"


def _row(kind: str, base: str, shape: Shape, hook: bool = True, name_attr: str | None = None) -> tuple[str, KindSpec]:
    return kind, KindSpec(kind=kind, base=base, shape=shape, hook=f"fv_register_{kind}" if hook else None, name_attr=name_attr)


KINDS: Mapping[str, KindSpec] = MappingProxyType(
    dict(
        [
            _row("model_cards", "fv_kernel.card:ModelCard", Shape.INSTANCE, name_attr="model_id"),
            _row("loops", "fv_kernel.loop:Loop", Shape.CLASS),
            _row("samplers", "fv_kernel.loop.samplers:Sampler", Shape.CLASS, name_attr="name"),
            _row("interceptors", "fv_kernel.extend:Interceptor", Shape.CLASS),
            _row("observers", "fv_kernel.extend:Observer", Shape.CLASS),
            _row("attention_backends", "fv_kernel.compute.attention:AttentionBackend", Shape.CLASS, hook=False),
            _row("transports", "fv_kernel.transport:Transport", Shape.CLASS, hook=False),
            _row("rl_methods", "fv_kernel.training:RLMethod", Shape.CLASS),
            _row("rewards", "fv_kernel.training:Reward", Shape.CLASS, name_attr="name"),
            _row("program_compilers", "fv_kernel.program:ProgramCompiler", Shape.CLASS),
        ]
    )
)

KIND_NAMES: tuple[str, ...] = tuple(KINDS)


def kind_spec(kind: str, kinds: Mapping[str, KindSpec] = KINDS) -> KindSpec:
    """The table row for ``kind``; unknown kinds name the allowed ones."""
    try:
        return kinds[kind]
    except KeyError:
        raise PluginError(f"unknown contribution kind {kind!r}; allowed: {', '.join(kinds)}") from None


def import_target(target: str) -> object:
    """Resolve a ``"module:attr"`` (attr may be dotted) import string."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise PluginError(f"import target {target!r} is not of the form 'module:attr'")
    obj: object = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_base(spec: KindSpec) -> type:
    """Import the kind's abstract base (lazily, on first use)."""
    try:
        base = import_target(spec.base)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"base {spec.base} of kind {spec.kind!r} is not available: {exc}") from exc
    if not isinstance(base, type):
        raise PluginError(f"base {spec.base} of kind {spec.kind!r} is not a class")
    return base


def check_satisfies(spec: KindSpec, obj: object, *, what: str) -> None:
    """Raise :class:`DriverTypeError` unless ``obj`` satisfies the kind's base.

    ``what`` names the contribution (entry point or namespaced id) in the message.
    """
    base = resolve_base(spec)
    if spec.shape is Shape.CLASS:
        ok = isinstance(obj, type) and issubclass(obj, base)
        expected = f"a subclass of {spec.base}"
    else:
        ok = isinstance(obj, base)
        expected = f"an instance of {spec.base}"
    if not ok:
        got = obj.__qualname__ if isinstance(obj, type) else f"{type(obj).__qualname__} instance"
        raise DriverTypeError(f"{what} ({spec.kind}) must be {expected}, got {got}")


def check_registered_name(spec: KindSpec, obj: object, name: str, *, what: str) -> None:
    """Raise :class:`PluginError` unless ``obj``'s own name (``spec.name_attr``) equals its registered ``name``."""
    if spec.name_attr is None:
        return
    own = getattr(obj, spec.name_attr, None)
    if own != name:
        raise PluginError(
            f"{what} is registered as {name!r} but its {spec.name_attr} is {own!r}; register {spec.kind} under their {spec.name_attr}"
        )
