"""The static plugin manifest, ``fv-plugin.yaml``, read without importing the plugin.

Each plugin package ships ``fv-plugin.yaml`` inside its top-level package
directory. The host derives the top-level package from the ``fv.plugins`` entry
point value and locates it with :func:`importlib.util.find_spec`, which finds the
directory without executing the package.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import KernelAPIMismatchError, ManifestError
from .kinds import KIND_NAMES

MANIFEST_FILENAME = "fv-plugin.yaml"


class ContributionDecl(BaseModel):
    """One declared contribution of a plugin."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    target: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    """Optional ``"module:attr"`` of the object; checked by ``fv plugins check``."""
    summary: str = ""


class CommandDecl(BaseModel):
    """One ``fv`` sub-command a plugin adds: ``fv <name>`` runs ``target``.

    ``fv --help`` lists it from the manifest alone; the target (a ``typer.Typer`` or a
    function) is imported only when the command runs (:mod:`fv_kernel.cli.plugin_commands`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    """``"module:attr"``: a ``typer.Typer`` (a group of sub-commands) or a function (one command)."""
    summary: str = ""
    """The one line ``fv --help`` shows."""


#: A plugin command's name: what follows ``fv`` on the command line.
COMMAND_NAME_PATTERN = r"^[a-z][a-z0-9-]*$"


class PluginManifest(BaseModel):
    """Typed contents of ``fv-plugin.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    version: str
    kernel_api: str
    """PEP 440 specifier set checked against :data:`fv_kernel.API_VERSION`, e.g. ``">=2.0,<3"``."""
    summary: str = ""
    contributions: dict[str, list[ContributionDecl]] = Field(default_factory=dict)
    commands: dict[str, CommandDecl] = Field(default_factory=dict)
    """``fv`` sub-commands by name (``fv <name> ...``); see :class:`CommandDecl`."""

    @field_validator("version")
    @classmethod
    def _pep440_version(cls, value: str) -> str:
        try:
            Version(value)
        except InvalidVersion:
            raise ValueError(f"version {value!r} is not a PEP 440 version") from None
        return value

    @field_validator("kernel_api")
    @classmethod
    def _specifier(cls, value: str) -> str:
        try:
            SpecifierSet(value)
        except InvalidSpecifier:
            raise ValueError(f"kernel_api {value!r} is not a PEP 440 specifier set (e.g. '>=2.0,<3')") from None
        return value

    @field_validator("contributions")
    @classmethod
    def _known_kinds_unique_names(cls, value: dict[str, list[ContributionDecl]]) -> dict[str, list[ContributionDecl]]:
        for kind, decls in value.items():
            if kind not in KIND_NAMES:
                raise ValueError(f"unknown contribution kind {kind!r}; allowed: {', '.join(KIND_NAMES)}")
            names = [d.name for d in decls]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"contributions.{kind} declares {', '.join(dupes)} more than once")
        return value

    @field_validator("commands")
    @classmethod
    def _command_names(cls, value: dict[str, CommandDecl]) -> dict[str, CommandDecl]:
        for name in value:
            if not re.match(COMMAND_NAME_PATTERN, name):
                raise ValueError(
                    f"command name {name!r} must be lower-case letters, digits and '-', starting with a letter"
                )
        return value

    def contribution_ids(self) -> dict[str, list[str]]:
        """Namespaced ids ``"<plugin>/<name>"`` per kind."""
        return {kind: [f"{self.name}/{d.name}" for d in decls] for kind, decls in self.contributions.items()}

    def check_kernel_api(self, kernel_api: str) -> None:
        """Raise :class:`KernelAPIMismatchError` unless ``kernel_api`` is in range."""
        if Version(kernel_api) not in SpecifierSet(self.kernel_api):
            raise KernelAPIMismatchError(self.name, self.kernel_api, kernel_api)

    def check_distribution(self, dist_name: str, dist_version: str | None) -> None:
        """The manifest must describe the distribution that ships it."""
        if canonicalize_name(self.name) != canonicalize_name(dist_name):
            raise ManifestError(f"manifest name {self.name!r} does not match distribution name {dist_name!r}")
        if dist_version is not None and Version(self.version) != Version(dist_version):
            raise ManifestError(
                f"manifest version {self.version!r} of {self.name!r} does not match "
                f"distribution version {dist_version!r}"
            )


def parse_manifest(data: Any, *, source: str) -> PluginManifest:
    """Validate already-loaded YAML data; errors name ``source`` and the field."""
    if not isinstance(data, dict):
        raise ManifestError(f"{source}: expected a mapping at top level, got {type(data).__name__}")
    try:
        return PluginManifest.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise ManifestError(f"{source}: invalid manifest: {problems}") from None


def load_manifest(path: Path) -> PluginManifest:
    """Read and validate one ``fv-plugin.yaml``."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from exc
    return parse_manifest(data, source=str(path))


def top_level_package(entry_point_value: str) -> str:
    """``"fv_wan.plugin"`` (or ``"fv_wan.plugin:obj"``) → ``"fv_wan"``."""
    module = entry_point_value.partition(":")[0].strip()
    top = module.split(".")[0]
    if not top.isidentifier():
        raise ManifestError(f"entry point value {entry_point_value!r} does not name a module")
    return top


def locate_manifest(entry_point_value: str) -> Path:
    """Find ``fv-plugin.yaml`` next to the plugin's top-level package, without importing it.

    ``find_spec`` on a top-level name consults the import finders only; it does not
    execute the package's ``__init__``.
    """
    top = top_level_package(entry_point_value)
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        raise ManifestError(f"cannot locate package {top!r}: {exc}") from exc
    if spec is None:
        raise ManifestError(f"package {top!r} (from entry point {entry_point_value!r}) is not importable")
    if not spec.submodule_search_locations:
        raise ManifestError(f"{top!r} is a module, not a package; {MANIFEST_FILENAME} must live in a package directory")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / MANIFEST_FILENAME
        if candidate.is_file():
            return candidate
    raise ManifestError(
        f"package {top!r} ships no {MANIFEST_FILENAME} (looked in {', '.join(spec.submodule_search_locations)}); "
        "add it as package data"
    )
