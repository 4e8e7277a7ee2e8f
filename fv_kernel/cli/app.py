"""Root of the ``fv`` CLI. Sub-commands live in their own modules and load when used.

``fv --help`` (and ``fv`` alone, and ``fv version``) imports none of them: they pull in
torch and the runtime, which take seconds to import, and the root only needs their names
and one-line summaries (:data:`LAZY_COMMANDS`; a test checks each summary against the
command's own help). ``-h`` is ``--help`` everywhere. Ctrl-C anywhere exits 130 with one
line on stderr.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import Any, NoReturn

import typer
from typer.core import TyperCommand, TyperGroup

from fv_kernel import API_VERSION, __version__

__all__ = ["app", "main", "run", "exit_now", "LAZY_COMMANDS", "HELP_OPTION_NAMES", "interrupted"]

HELP_OPTION_NAMES = ["-h", "--help"]


@dataclass(frozen=True)
class LazyCommand:
    """Where a sub-command is defined, and its one-line summary for ``fv --help``."""

    module: str
    attribute: str
    summary: str


LAZY_COMMANDS: dict[str, LazyCommand] = {
    "adapters": LazyCommand("fv_kernel.cli.adapters_cmd", "adapters_app", "List LoRA adapters as a deployment registers them."),
    "cards": LazyCommand("fv_kernel.cli.cards_cmd", "cards_app", "List, show and validate model cards."),
    "generate": LazyCommand(
        "fv_kernel.cli.generate_cmd", "generate", "Generate a video (or image) with one card and write it to --output."
    ),
    "plugins": LazyCommand("fv_kernel.cli.plugins_cmd", "plugins_app", "Inspect and validate fv plugins."),
    "quantize": LazyCommand(
        "fv_kernel.cli.quantize_cmd", "quantize",
        "Write a card's fp8 weights (e4m3, per-channel scales) and a card that loads them without quantizing again.",
    ),
    "realtime": LazyCommand(
        "fv_kernel.cli.realtime_cmd", "realtime",
        "Stream a realtime session of a causal card to --output, with prompt updates typed on stdin.",
    ),
    "serve": LazyCommand(
        "fv_kernel.cli.serve_cmd", "serve",
        "Serve the OpenAI-style video API (POST /v1/videos, SSE events, /metrics) over the deployment.",
    ),
    "train": LazyCommand(
        "fv_kernel.cli.train_cmd", "train",
        "Train a card with a registered method and export it as a checkpoint fv (and its reference) load.",
    ),
}


def interrupted() -> NoReturn:
    """Ctrl-C: one line on stderr, exit status 130 (128 + SIGINT), no traceback."""
    _quiet_teardown()
    typer.echo("fv: interrupted", err=True)
    raise typer.Exit(130)


def _quiet_teardown() -> None:
    # Ctrl-C can land inside an object's constructor (an event loop half made by asyncio.run);
    # its __del__ then fails at exit and Python prints "Exception ignored ..." with a traceback.
    # A coroutine Ctrl-C stopped before it was awaited warns likewise. We are exiting on purpose:
    # say nothing more than the one line.
    sys.unraisablehook = lambda _unraisable: None
    warnings.simplefilter("ignore")
    # asyncio logs, not raises: a task destroyed while still pending at exit, one that fails while
    # asyncio.run's shutdown cancels it (with its traceback).
    logging.getLogger("asyncio").disabled = True


def load_command(name: str) -> Any:
    """The command ``name`` as Typer's (vendored) click command, importing its module."""
    entry = LAZY_COMMANDS[name]
    return _as_click_command(name, getattr(importlib.import_module(entry.module), entry.attribute))


def _as_click_command(name: str, target: Any) -> Any:
    """A ``typer.Typer`` as its group, a function as one command named ``name``."""
    if isinstance(target, typer.Typer):
        return typer.main.get_group(target)  # shell completion options belong to the root only
    single = typer.Typer(add_completion=False)
    single.command(name)(target)
    return typer.main.get_command(single)  # one command and no callback: the command itself


class _LazyGroup(TyperGroup):
    """A group whose lazy sub-commands are imported only when invoked (or their own help is asked)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listing = False
        self._loaded: dict[str, Any] = {}
        self._plugin_commands: Any = None
        self._conflicts_said = False

    def plugin_commands(self) -> Any:
        """Commands the installed plugins declare (``fv_kernel.cli.plugin_commands``), read once, nothing imported."""
        if self._plugin_commands is None:
            from fv_kernel.cli.plugin_commands import discover_plugin_commands

            self._plugin_commands = discover_plugin_commands({*LAZY_COMMANDS, *self.commands})
        return self._plugin_commands

    def list_commands(self, ctx: Any) -> list[str]:
        found = self.plugin_commands()
        if self._listing and not self._conflicts_said:  # help may list twice; say each refusal once
            self._conflicts_said = True
            for conflict in found.conflicts:
                typer.echo(f"fv: {conflict}", err=True)
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS, *found.commands})

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in LAZY_COMMANDS and cmd_name not in self.commands:
            plugin_command = self.plugin_commands().commands.get(cmd_name)
            if plugin_command is not None:
                return self._plugin_command(plugin_command)
        if cmd_name not in LAZY_COMMANDS:
            return super().get_command(ctx, cmd_name)
        if self._listing:  # the root's help lists names and summaries only
            return TyperCommand(cmd_name, help=LAZY_COMMANDS[cmd_name].summary)
        if cmd_name not in self._loaded:
            from fv_kernel.io.progress import spinner

            try:
                with spinner(f"starting fv {cmd_name}"):  # importing torch and the runtime takes seconds
                    self._loaded[cmd_name] = load_command(cmd_name)
            except KeyboardInterrupt:
                interrupted()
        return self._loaded[cmd_name]

    def _plugin_command(self, command: Any) -> Any:
        """A plugin's command: its summary while listing, else its target imported (refused in one line)."""
        if self._listing:
            return TyperCommand(command.name, help=command.summary)
        if command.name not in self._loaded:
            from fv_kernel.cli.plugin_commands import PluginCommandError, load_plugin_command
            from fv_kernel.io.progress import spinner

            try:
                with spinner(f"starting fv {command.name}"):
                    self._loaded[command.name] = _as_click_command(command.name, load_plugin_command(command))
            except PluginCommandError as exc:
                typer.echo(f"fv: {exc}", err=True)
                raise typer.Exit(2) from None
            except KeyboardInterrupt:
                interrupted()
        return self._loaded[command.name]

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # typer would exit 130 without a word
            interrupted()

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    name="fv",
    cls=_LazyGroup,
    help="fv: a model-native runtime for video generation.",
    no_args_is_help=True,
    context_settings={"help_option_names": HELP_OPTION_NAMES},
)


@app.callback()
def _root() -> None:
    """fv: a model-native runtime for video generation."""  # a group, although only `version` is registered here


@app.command("version")
def version() -> None:
    """Print the kernel version and the plugin API version."""
    typer.echo(f"fv-kernel {__version__} (plugin API {API_VERSION})")


def main() -> None:
    """The ``fv`` CLI in this process (raises ``SystemExit`` as click does; :func:`run` is the console script)."""
    try:
        app()
    except KeyboardInterrupt:  # between the commands' own handlers (argument parsing, start-up)
        _quiet_teardown()
        typer.echo("fv: interrupted", err=True)
        sys.exit(130)


def run() -> NoReturn:
    """Console-script entry point (``fv``): :func:`main`, then :func:`exit_now` with its status."""
    try:
        main()
    except SystemExit as exc:
        exit_now(exc.code)
    exit_now(0)


def exit_now(code: int | str | None = 0) -> NoReturn:
    """End the process as ``sys.exit(code)`` would, without the interpreter's teardown.

    Python's exit frees every module and object one by one; with torch imported that took about 0.6 s
    on a 2-core CPU after each command (docs/benchmarks.md, "Cold start"). What an exit must still do
    is done first: wait for the threads that are not daemons, run the ``atexit`` handlers, print a
    string status to stderr (as ``sys.exit`` does) and flush stdout and stderr. Then ``os._exit``.
    """
    import atexit
    import os
    import threading

    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(0 if code is None else int(code))


if __name__ == "__main__":
    run()
