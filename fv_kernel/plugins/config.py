"""Deploy-scope plugin selection: the ``plugins:`` section of the deploy config and ``FV_PLUGINS``.

Plugins are chosen by the operator at deploy scope only; a request can never name
plugins, it can only parameterise ones that are already enabled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from fv_kernel import DISTRIBUTION as KERNEL_DISTRIBUTION

from .errors import PluginConfigError

__all__ = ["FV_PLUGINS_ENV", "KERNEL_DISTRIBUTION", "PluginsConfig", "Selection", "select"]

FV_PLUGINS_ENV = "FV_PLUGINS"
# KERNEL_DISTRIBUTION: the kernel's own distribution. Its built-ins (sdpa, inproc, the stock
# samplers) are part of the kernel, so no selection can switch them off.


def _parse_selector(text: str, *, field: str) -> Requirement:
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        raise ValueError(f"{field}: {text!r} is not a distribution name with an optional PEP 440 specifier ({exc})") from None
    if req.extras or req.url or req.marker:
        raise ValueError(f"{field}: {text!r} may hold only a name and a version specifier")
    return req


#: A distribution name as PEP 508 spells one (no version specifier).
_DISTRIBUTION_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")


class PluginsConfig(BaseModel):
    """Which installed plugins run in this deployment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    autoload: bool = True
    """Enable every discovered plugin that is not disabled."""
    enable: list[str] = []
    """Explicitly enabled plugins, ``"name"`` or ``"name>=1,<2"``; failing to load one is fatal."""
    disable: list[str] = []
    """Plugins never loaded, ``"name"`` or ``"name<2"``."""
    strict: bool = False
    """Treat autoloaded plugins that fail to load as fatal too."""
    settings: dict[str, dict[str, Any]] = {}
    """Per-plugin settings by distribution name, ``{fv-foo: {key: value}}``. Each plugin reads its
    own mapping (:meth:`settings_for`) and validates it; the kernel checks only that each name is
    a distribution name, given once, and (when the host starts) installed."""

    @field_validator("enable", "disable")
    @classmethod
    def _valid_selectors(cls, value: list[str], info: object) -> list[str]:
        field = getattr(info, "field_name", "selector")
        for item in value:
            _parse_selector(item, field=field)
        return value

    @field_validator("settings")
    @classmethod
    def _settings_names(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        seen: dict[str, str] = {}
        for name in value:
            if not _DISTRIBUTION_NAME.match(name):
                raise ValueError(f"settings: {name!r} is not a distribution name (letters, digits, '.', '_', '-')")
            key = canonicalize_name(name)
            if key in seen:
                raise ValueError(f"settings: {seen[key]!r} and {name!r} name the same plugin")
            seen[key] = name
        return value

    def settings_for(self, distribution: str) -> dict[str, Any]:
        """The ``settings`` mapping of ``distribution`` (its name compared canonically), or ``{}``."""
        key = canonicalize_name(distribution)
        for name, values in self.settings.items():
            if canonicalize_name(name) == key:
                return dict(values)
        return {}

    @model_validator(mode="after")
    def _consistent(self) -> "PluginsConfig":
        enabled = {canonicalize_name(Requirement(s).name) for s in self.enable}
        disabled = {canonicalize_name(Requirement(s).name) for s in self.disable}
        both = sorted(enabled & disabled)
        if both:
            raise ValueError(f"plugins listed in both enable and disable: {', '.join(both)}")
        if canonicalize_name(KERNEL_DISTRIBUTION) in disabled:
            raise ValueError(f"disable: {KERNEL_DISTRIBUTION!r} holds the kernel's built-ins and cannot be disabled")
        return self

    def with_env(self, environ: Mapping[str, str]) -> "PluginsConfig":
        """Apply ``FV_PLUGINS``: unset keeps this config; ``""`` enables none; ``"a,b"`` enables exactly a and b.

        When set, ``FV_PLUGINS`` replaces ``autoload``/``enable``/``disable`` entirely, and the
        names it lists count as explicitly enabled.
        """
        raw = environ.get(FV_PLUGINS_ENV)
        if raw is None:
            return self
        names = [part.strip() for part in raw.split(",") if part.strip()]
        try:
            for name in names:
                _parse_selector(name, field=FV_PLUGINS_ENV)
        except ValueError as exc:
            raise PluginConfigError(str(exc)) from None
        return PluginsConfig(autoload=False, enable=names, disable=[], strict=self.strict, settings=self.settings)

    def requirements(self) -> tuple[dict[str, Requirement], dict[str, Requirement]]:
        """(enable, disable) selectors keyed by canonical distribution name."""
        enable = {canonicalize_name(r.name): r for r in map(Requirement, self.enable)}
        disable = {canonicalize_name(r.name): r for r in map(Requirement, self.disable)}
        return enable, disable


@dataclass(frozen=True)
class Selection:
    """The config's verdict on one discovered plugin."""

    enabled: bool
    explicit: bool
    reason: str
    problem: str | None = None
    """Set when an explicitly enabled plugin cannot satisfy its selector (e.g. wrong version)."""


def select(config: PluginsConfig, dist_name: str, dist_version: str | None) -> Selection:
    """Decide whether ``dist_name`` runs under ``config`` (already merged with the environment)."""
    key = canonicalize_name(dist_name)
    if key == canonicalize_name(KERNEL_DISTRIBUTION):
        return Selection(enabled=True, explicit=True, reason="kernel built-ins")
    enable, disable = config.requirements()
    if key in disable:
        req = disable[key]
        if not req.specifier or (dist_version is not None and req.specifier.contains(dist_version, prereleases=True)):
            return Selection(enabled=False, explicit=False, reason=f"disabled by {str(req)!r}")
    if key in enable:
        req = enable[key]
        if req.specifier and (dist_version is None or not req.specifier.contains(dist_version, prereleases=True)):
            return Selection(
                enabled=True,
                explicit=True,
                reason=f"enabled by {str(req)!r}",
                problem=f"installed version {dist_version} does not satisfy the enable selector {str(req)!r}",
            )
        return Selection(enabled=True, explicit=True, reason=f"enabled by {str(req)!r}")
    if config.autoload:
        return Selection(enabled=True, explicit=False, reason="autoload")
    return Selection(enabled=False, explicit=False, reason="not enabled (autoload is off)")
