"""Discovery: the ``fv.*`` entry points of installed distributions, read from metadata alone.

Nothing is imported here; the host decides what to load (:mod:`fv_kernel.plugins.host`).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import Mapping, Sequence

from packaging.utils import canonicalize_name

from .config import KERNEL_DISTRIBUTION

__all__ = [
    "PLUGINS_GROUP", "DRIVER_GROUP_PREFIX", "DiscoveredPlugin", "EntryPointScan", "scan_entry_points",
    "scan_kernel_distribution",
]

PLUGINS_GROUP = "fv.plugins"
DRIVER_GROUP_PREFIX = "fv."



@dataclass(frozen=True)
class DiscoveredPlugin:
    """A distribution's ``fv.plugins`` entry point, as found in metadata (nothing imported)."""

    distribution: str
    version: str | None
    entry_point: EntryPoint

    @property
    def entry_point_text(self) -> str:
        return f"{self.entry_point.name} = {self.entry_point.value}"


@dataclass(frozen=True)
class EntryPointScan:
    """One scan of installed metadata: plugin entry points and driver entry points by group."""

    plugins: tuple[DiscoveredPlugin, ...]
    drivers: Mapping[str, tuple[EntryPoint, ...]]


def scan_entry_points(search_path: Sequence[str] | None = None) -> EntryPointScan:
    """Read ``fv.*`` entry points from installed distributions (metadata only).

    ``search_path`` restricts the scan to those directories (default: ``sys.path``).
    A distribution visible twice on the path counts once, the first one winning,
    as for imports.
    """
    dists = (
        importlib.metadata.distributions()
        if search_path is None
        else importlib.metadata.distributions(path=list(search_path))
    )
    seen: set[str] = set()
    plugins: list[DiscoveredPlugin] = []
    drivers: dict[str, list[EntryPoint]] = {}
    for dist in dists:
        name = dist.metadata["Name"]
        if not name or canonicalize_name(name) in seen:
            continue
        seen.add(canonicalize_name(name))
        _sort_entry_points(dist, plugins, drivers)
    plugins.sort(key=lambda p: canonicalize_name(p.distribution))
    return EntryPointScan(plugins=tuple(plugins), drivers={g: tuple(eps) for g, eps in drivers.items()})


def scan_kernel_distribution() -> EntryPointScan:
    """The kernel's own ``fv.*`` entry points (its built-ins), read from its metadata alone."""
    try:
        dist = importlib.metadata.distribution(KERNEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return EntryPointScan((), {})
    plugins: list[DiscoveredPlugin] = []
    drivers: dict[str, list[EntryPoint]] = {}
    _sort_entry_points(dist, plugins, drivers)
    return EntryPointScan(plugins=tuple(plugins), drivers={g: tuple(eps) for g, eps in drivers.items()})


def _sort_entry_points(
    dist: importlib.metadata.Distribution, plugins: list[DiscoveredPlugin], drivers: dict[str, list[EntryPoint]]
) -> None:
    """Append one distribution's ``fv.plugins`` entry points to ``plugins`` and its driver entry points to ``drivers`` by group."""
    for ep in dist.entry_points:
        if ep.group == PLUGINS_GROUP:
            plugins.append(DiscoveredPlugin(distribution=dist.metadata["Name"], version=dist.version, entry_point=ep))
        elif ep.group.startswith(DRIVER_GROUP_PREFIX):
            drivers.setdefault(ep.group, []).append(ep)
