"""The deploy-scope registry: the samplers, loops and attention backends one deployment may use.

A deployment's :class:`~fv_kernel.plugins.host.PluginHost` builds it from its enabled
plugins (:meth:`PluginHost.registry`); the kernel's built-ins are among them, registered
like any plugin's. Instances carry the registry they were built with
(``InstanceOptions.registry``), so a card's loop spec, a sampler state and a deploy
config's ``attention_backend`` resolve by name in that deployment and nowhere else: a
plugin that is installed but not enabled contributes nothing.

:func:`kernel_registry` is what code that was given no registry uses: the kernel's
built-ins only.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Mapping

from .config import KERNEL_DISTRIBUTION
from .discovery import scan_kernel_distribution
from .drivers import DriverRegistry
from .hooks import Contribution, find_contribution
from .kinds import kind_spec

# The classes a registry holds are imported only where one is built or loaded: the host (and
# `fv --help`) reads plugin metadata without importing torch.
if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.compute.attention import AttentionBackend
    from fv_kernel.loop.contract import Loop
    from fv_kernel.loop.samplers import Sampler

__all__ = ["DeployRegistry", "kernel_registry", "load_attention_backend"]


class DeployRegistry:
    """Contributions of one deployment's enabled plugins, by namespaced id or unique short name.

    Immutable. Short names are unique per kind within a deployment (the host refuses a
    plugin that contributes a name another plugin already does), so both forms resolve.
    """

    def __init__(
        self,
        *,
        samplers: Iterable[Contribution] = (),
        loops: Iterable[Contribution] = (),
        attention_backends: DriverRegistry | None = None,
    ) -> None:
        self._samplers = _by_id(samplers)
        self._loops = _by_id(loops)
        self.attention_backends: DriverRegistry = (
            attention_backends if attention_backends is not None else DriverRegistry("attention_backends", [])
        )
        names: dict[str, type] = {}
        for contribution in self._samplers.values():
            names[contribution.id] = contribution.obj  # type: ignore[assignment]
            names[contribution.name] = contribution.obj  # type: ignore[assignment]
        self._sampler_lookup: Mapping[str, type] = MappingProxyType(names)

    # ------------------------------------------------------------------ samplers
    @property
    def samplers(self) -> Mapping[str, "type[Sampler]"]:
        """Sampler classes by namespaced id and by short name (read-only)."""
        return self._sampler_lookup  # type: ignore[return-value]

    def sampler_names(self) -> list[str]:
        """Short sampler names, sorted: what ``--sampler`` and ``SamplerBinding.name`` accept."""
        return sorted(c.name for c in self._samplers.values())

    def sampler(self, name: str) -> "type[Sampler]":
        return _lookup(self._samplers, "samplers", name).obj  # type: ignore[return-value]

    # ------------------------------------------------------------------ loops
    def loop_ids(self) -> list[str]:
        return sorted(self._loops)

    def loop(self, name: str) -> "type[Loop]":
        """The loop class registered as ``name`` (namespaced id or unique short name)."""
        return _lookup(self._loops, "loops", name).obj  # type: ignore[return-value]

    # ------------------------------------------------------------------ attention
    def attention_backend(self, name: str) -> "AttentionBackend":
        """Construct the attention driver ``name`` of an enabled plugin (or the kernel)."""
        from fv_kernel.plugins.registry import load_attention_backend

        return load_attention_backend(name, self.attention_backends)

    def replace(self, *, attention_backends: DriverRegistry | None = None) -> "DeployRegistry":
        """A copy with other attention drivers (an embedding application's own, a test's)."""
        return DeployRegistry(
            samplers=self._samplers.values(),
            loops=self._loops.values(),
            attention_backends=attention_backends if attention_backends is not None else self.attention_backends,
        )

    def __repr__(self) -> str:
        return (
            f"DeployRegistry(samplers={self.sampler_names()}, loops={self.loop_ids()}, "
            f"attention_backends={self.attention_backends.names()})"
        )


def _by_id(contributions: Iterable[Contribution]) -> Mapping[str, Contribution]:
    return MappingProxyType({c.id: c for c in contributions})


def _lookup(found: Mapping[str, Contribution], kind: str, name: str) -> Contribution:
    return find_contribution(found, kind, name, scope=" is enabled in this deployment")


@functools.cache
def kernel_registry() -> DeployRegistry:
    """The kernel's built-ins alone (immutable, built once): samplers and attention drivers.

    Code given no deploy registry resolves through this. It reads the kernel's own
    metadata only, never the entry points of other installed distributions, which may
    belong to plugins a deployment disabled.
    """
    from fv_kernel.loop.samplers import builtin_samplers

    samplers = [Contribution("samplers", KERNEL_DISTRIBUTION, name, cls) for name, cls in builtin_samplers().items()]
    own = scan_kernel_distribution().drivers.get(kind_spec("attention_backends").entry_point_group, ())
    return DeployRegistry(samplers=samplers, attention_backends=DriverRegistry("attention_backends", own))


def load_attention_backend(name: str, registry: DriverRegistry | None = None) -> "AttentionBackend":
    """Construct the attention driver registered as ``name``.

    ``registry`` is a deployment's ``DeployRegistry.attention_backends`` (its host's
    ``drivers("attention_backends")``), so only enabled plugins count and a disabled plugin's
    driver is refused naming why. None means the kernel's built-in drivers alone, never every
    installed distribution.
    """
    from fv_kernel.compute.attention import AttentionBackend

    drivers = registry if registry is not None else kernel_registry().attention_backends
    backend = drivers.load(name)()
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"attention driver {name!r} built a {type(backend).__name__}, not an AttentionBackend")
    return backend
