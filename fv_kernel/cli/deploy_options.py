"""What every command that selects plugins shares: one ``--config``, one strict loader, one start-up.

``fv plugins list``, ``fv cards list/show/validate``, ``fv generate`` and ``fv serve`` all
take the same ``--config`` option, read by :func:`fv_kernel.config.load_deploy_config`
(an unknown key anywhere is an error naming its path), and start the plugin host the
same way: a plugin that was explicitly enabled (``FV_PLUGINS`` or ``plugins.enable``),
or any plugin under ``plugins.strict``, that fails stops the command with one
``error:`` line and exit code 2; an autoloaded plugin that fails is one ``warning:``
line and the command goes on without it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Optional

import typer

from fv_kernel.plugins import PluginError, PluginHost, PluginWarning

if TYPE_CHECKING:  # the deploy config imports the engine (torch); `fv --help` must stay light
    from fv_kernel.config import DeployConfig

__all__ = ["ConfigOption", "fail", "load_config", "start_host"]

ConfigOption = typer.Option(
    None,
    "--config",
    "-c",
    help="Deploy config YAML (unknown keys are errors); its 'plugins:' section selects the plugins.",
    exists=True,
    dir_okay=False,
)


def fail(message: str, code: int = 2) -> NoReturn:
    """One ``error:`` line on stderr, then exit ``code``."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise typer.Exit(code)


def load_config(path: Optional[Path]) -> "DeployConfig":
    """The deploy config at ``path`` (the defaults when None), or one ``error:`` line naming the bad key."""
    from fv_kernel.config import DeployConfig, DeployConfigError, load_deploy_config

    if path is None:
        return DeployConfig()
    try:
        return load_deploy_config(path)
    except DeployConfigError as exc:
        fail(exc.message)


def start_host(config: "DeployConfig") -> PluginHost:
    """A started host for ``config``'s plugin selection (plus ``FV_PLUGINS``).

    Fatal plugin failures end the command with one ``error:`` line and nothing else; the
    autoloaded plugins that were skipped are reported as ``warning:`` lines only when the
    command goes on.
    """
    try:
        host = PluginHost(config.plugins)
    except PluginError as exc:  # a malformed FV_PLUGINS
        fail(str(exc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginWarning)
        try:
            host.start()
        except PluginError as exc:
            fail(str(exc))
    for warning in caught:
        if issubclass(warning.category, PluginWarning):
            typer.echo(f"warning: {warning.message}", err=True)
        else:  # not ours to reword: show it as Python would have
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    return host
