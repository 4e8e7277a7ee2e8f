"""The fv plugin host: manifests, hook specs, deploy-scope selection, named drivers.

Public contract for plugin authors (see ``docs/plugins.md``):

- entry-point group ``fv.plugins``: ``<distribution name> = <plugin module>``;
- entry-point groups ``fv.<kind>`` (e.g. ``fv.attention_backends``): ``<name> = "module:Class"``;
- ``fv-plugin.yaml`` in the plugin's top-level package (:class:`PluginManifest`);
- the hooks in :mod:`fv_kernel.plugins.hookspecs`, implemented with :data:`hookimpl`
  (plugins import it, and everything else, from :mod:`fv_kernel.api`).

A deployment's host (:class:`PluginHost`) loads the selected plugins, contains the ones
that fail, and builds the deploy-scope :class:`DeployRegistry` that names resolve through.
"""

from .config import FV_PLUGINS_ENV, PluginsConfig
from .drivers import DriverRegistry
from .errors import (
    DriverTypeError,
    DuplicateContributionError,
    KernelAPIMismatchError,
    ManifestError,
    PluginConfigError,
    PluginError,
    PluginLoadError,
    UnknownContributionError,
    UnknownDriverError,
)
from .hooks import Contribution, PluginHooks
from .hookspecs import hookimpl
from .discovery import PLUGINS_GROUP, DiscoveredPlugin
from .host import PluginHost, PluginRecord, PluginStatus, PluginWarning, get_host
from .kinds import KIND_NAMES, KINDS, KindSpec, Shape
from .manifest import MANIFEST_FILENAME, ContributionDecl, PluginManifest, load_manifest, locate_manifest
from .registry import DeployRegistry, kernel_registry

__all__ = [
    "FV_PLUGINS_ENV",
    "KINDS",
    "KIND_NAMES",
    "MANIFEST_FILENAME",
    "PLUGINS_GROUP",
    "Contribution",
    "ContributionDecl",
    "DeployRegistry",
    "DiscoveredPlugin",
    "DriverRegistry",
    "DriverTypeError",
    "DuplicateContributionError",
    "KernelAPIMismatchError",
    "KindSpec",
    "ManifestError",
    "PluginConfigError",
    "PluginError",
    "PluginHooks",
    "PluginHost",
    "PluginLoadError",
    "PluginManifest",
    "PluginRecord",
    "PluginStatus",
    "PluginWarning",
    "PluginsConfig",
    "Shape",
    "UnknownContributionError",
    "UnknownDriverError",
    "get_host",
    "hookimpl",
    "kernel_registry",
    "load_manifest",
    "locate_manifest",
]
