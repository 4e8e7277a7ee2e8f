"""Named-driver registries: lazy ``"module:Class"`` entry points in ``fv.<kind>`` groups.

Listing a registry reads entry-point metadata only. Loading goes through stevedore's
:class:`~stevedore.driver.DriverManager` with ``invoke_on_load=False``, which imports the
selected entry point and nothing else, and the class is then checked against its kind's base.
"""

from __future__ import annotations

import importlib.metadata
from importlib.metadata import EntryPoint
from typing import Any, Mapping, Sequence

from stevedore import DriverManager

from .errors import DuplicateContributionError, PluginError, UnknownDriverError
from .kinds import KINDS, KindSpec, check_satisfies, kind_spec


def entry_point_distribution(ep: EntryPoint) -> str | None:
    """The distribution name that declared ``ep`` (None for hand-made entry points)."""
    dist = getattr(ep, "dist", None)
    return None if dist is None else dist.metadata["Name"]


def describe_entry_point(ep: EntryPoint) -> str:
    """``"group: name = value (dist)"``, for messages."""
    dist = entry_point_distribution(ep)
    return f"{ep.group}: {ep.name} = {ep.value}" + (f" (from {dist})" if dist else "")


class _PreScannedDriverManager(DriverManager):  # type: ignore[misc]
    """A stevedore DriverManager that loads from entry points the host already scanned.

    stevedore caches its own scan per namespace for the whole process, which would
    ignore the deploy-scope selection and the hermetic hosts tests use.
    """

    def __init__(self, namespace: str, name: str, entry_points: Sequence[EntryPoint]) -> None:
        self._prescanned = list(entry_points)
        super().__init__(namespace=namespace, name=name, invoke_on_load=False)

    def list_entry_points(self) -> list[EntryPoint]:
        return self._prescanned


class DriverRegistry:
    """The named drivers of one kind, e.g. ``DriverRegistry("attention_backends")``.

    ``entry_points`` are the group's entry points (the host passes those of enabled
    plugins only); ``None`` scans installed metadata directly. ``ignored`` maps driver
    names the host left out to the reason, so lookups can say why a name is missing.
    """

    def __init__(
        self,
        kind: str,
        entry_points: Sequence[EntryPoint] | None = None,
        *,
        kinds: Mapping[str, KindSpec] = KINDS,
        ignored: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = kind_spec(kind, kinds)
        if entry_points is None:
            entry_points = list(importlib.metadata.entry_points(group=self.spec.entry_point_group))
        wrong = [ep for ep in entry_points if ep.group != self.spec.entry_point_group]
        if wrong:
            raise PluginError(f"entry points {[describe_entry_point(e) for e in wrong]} are not in group {self.spec.entry_point_group}")
        self._entry_points = list(entry_points)
        self._ignored = dict(ignored or {})

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def group(self) -> str:
        return self.spec.entry_point_group

    def names(self) -> list[str]:
        """Short driver names, from metadata only (nothing is imported)."""
        return sorted({ep.name for ep in self._entry_points})

    def ids(self) -> list[str]:
        """Namespaced ids ``"<distribution>/<name>"``."""
        return sorted(f"{entry_point_distribution(ep) or '?'}/{ep.name}" for ep in self._entry_points)

    def entry_point(self, name: str) -> EntryPoint:
        """The entry point for a short name (unique) or a namespaced id ``"dist/name"``."""
        if "/" in name:
            dist, _, short = name.partition("/")
            matches = [
                ep for ep in self._entry_points if ep.name == short and (entry_point_distribution(ep) or "?") == dist
            ]
        else:
            matches = [ep for ep in self._entry_points if ep.name == name]
        if not matches:
            available = ", ".join(self.names()) or "<none>"
            hint = f"; {name!r} was left out: {self._ignored[name]}" if name in self._ignored else ""
            raise UnknownDriverError(f"no {self.kind} driver named {name!r} in group {self.group}; available: {available}{hint}")
        if len(matches) > 1:
            raise DuplicateContributionError(
                f"{self.kind} driver name {name!r} is ambiguous: "
                + " and ".join(describe_entry_point(ep) for ep in matches)
                + "; select it by namespaced id '<distribution>/<name>'"
            )
        return matches[0]

    def load(self, name: str) -> type[Any]:
        """Import exactly the selected driver class and check it against the kind's base."""
        ep = self.entry_point(name)
        try:
            manager = _PreScannedDriverManager(self.group, ep.name, [ep])
            driver = manager.driver
        except Exception as exc:  # the driver's own import error, whatever its type
            raise PluginError(f"cannot load {describe_entry_point(ep)}: {type(exc).__name__}: {exc}") from exc
        check_satisfies(self.spec, driver, what=f"entry point {describe_entry_point(ep)}")
        return driver  # type: ignore[no-any-return]
