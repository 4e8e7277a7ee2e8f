"""Plugin CLI commands: declared in ``fv-plugin.yaml`` (``commands:``), listed without importing the
plugin, run by importing it, refused in one line when the plugin is disabled or broken, and never
allowed to shadow a kernel command or another plugin's."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from fv_kernel.cli.app import LAZY_COMMANDS, app
from fv_kernel.cli.plugin_commands import PluginCommandConflict, discover_plugin_commands

runner = CliRunner()
PACKAGES = ("fv_cmdgood", "fv_cmdbroken", "fv_cmdshadow", "fv_cmdold", "fv_cmdbadyaml", "fv_cmdtwin", "fv_cmdnotcallable")


def _write_plugin(site: Path, dist: str, manifest: str, files: dict[str, str], *, version: str = "0.1.0") -> None:
    package = dist.replace("-", "_")
    pkg = site / package
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fv-plugin.yaml").write_text(textwrap.dedent(manifest))
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    info = site / f"{package}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[fv.plugins]\n{dist} = {package}.plugin\n")


@pytest.fixture(scope="module")
def command_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("command_site")
    _write_plugin(site, "fv-cmdgood", """\
        name: fv-cmdgood
        version: "0.1.0"
        kernel_api: ">=2.0,<3"
        commands:
          hello: {target: "fv_cmdgood.cli:hello", summary: "Say hello from a plugin."}
          toolbox: {target: "fv_cmdgood.cli:toolbox_app", summary: "A group of plugin tools."}
        """, {
        "plugin.py": "IMPORTED = True\n",
        "cli.py": """\
            import typer

            def hello(name: str = typer.Option("world", "--name")) -> None:
                \"\"\"Say hello from a plugin.\"\"\"
                typer.echo(f"hello {name}")

            toolbox_app = typer.Typer(help="A group of plugin tools.")

            @toolbox_app.command("count")
            def count(n: int) -> None:
                typer.echo(" ".join(str(i) for i in range(n)))

            @toolbox_app.command("noop")
            def noop() -> None:
                pass
            """,
    })
    _write_plugin(site, "fv-cmdbroken", """\
        name: fv-cmdbroken
        version: "0.1.0"
        kernel_api: ">=2.0,<3"
        commands:
          explode: {target: "fv_cmdbroken.cli:run", summary: "Never runs."}
        """, {"plugin.py": "", "cli.py": "raise RuntimeError('fv_cmdbroken exploded at import')\n"})
    _write_plugin(site, "fv-cmdshadow", """\
        name: fv-cmdshadow
        version: "0.1.0"
        kernel_api: ">=2.0,<3"
        commands:
          serve: {target: "fv_cmdshadow.cli:serve", summary: "Tries to replace fv serve."}
          hello: {target: "fv_cmdshadow.cli:serve", summary: "Tries to take fv-cmdgood's hello."}
        """, {"plugin.py": "", "cli.py": "def serve() -> None:\n    print('shadowed!')\n"})
    _write_plugin(site, "fv-cmdold", """\
        name: fv-cmdold
        version: "0.1.0"
        kernel_api: ">=3.0,<4"
        commands:
          old: {target: "fv_cmdold.cli:old", summary: "Needs kernel API 3."}
        """, {"plugin.py": "", "cli.py": "def old() -> None:\n    print('old ran')\n"})
    _write_plugin(site, "fv-cmdbadyaml", """\
        name: fv-cmdbadyaml
        version: "0.1.0"
        kernel_api: ">=2.0,<3"
        commands:
          badtarget: {target: "not a target", summary: "Invalid target."}
        """, {"plugin.py": "", "cli.py": ""})
    _write_plugin(site, "fv-cmdnotcallable", """\
        name: fv-cmdnotcallable
        version: "0.1.0"
        kernel_api: ">=2.0,<3"
        commands:
          number: {target: "fv_cmdnotcallable.cli:NUMBER", summary: "Not a command."}
          missing: {target: "fv_cmdnotcallable.cli:nowhere", summary: "Not there."}
        """, {"plugin.py": "", "cli.py": "NUMBER = 3\n"})
    return site


def _forget() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]


@pytest.fixture
def site(command_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.delenv("FV_PLUGINS", raising=False)
    monkeypatch.syspath_prepend(str(command_site))
    importlib.invalidate_caches()
    _forget()
    yield command_site
    _forget()


def test_help_lists_plugin_commands_without_importing_them(site: Path) -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    assert "hello" in result.stdout and "Say hello from a plugin." in result.stdout
    assert "toolbox" in result.stdout and "explode" in result.stdout
    assert not any(name.split(".")[0] in PACKAGES for name in sys.modules)
    # the shadowing one is refused, in one line, while the kernel's serve stays listed
    assert "plugin fv-cmdshadow's command 'serve' is refused: it would shadow the kernel command 'fv serve'" in result.stderr
    assert "Tries to replace fv serve." not in result.stdout


def test_function_and_group_commands_run(site: Path) -> None:
    result = runner.invoke(app, ["hello", "--name", "fv"])
    assert result.exit_code == 0 and result.stdout.strip() == "hello fv", result.output
    assert "fv_cmdgood.plugin" in sys.modules  # the plugin's entry point is imported before its command
    result = runner.invoke(app, ["toolbox", "count", "3"])
    assert result.exit_code == 0 and result.stdout.strip() == "0 1 2", result.output
    assert runner.invoke(app, ["toolbox", "-h"]).exit_code == 0


def test_a_kernel_command_is_never_shadowed(site: Path) -> None:
    found = discover_plugin_commands({*LAZY_COMMANDS, "version"})
    assert found.commands["hello"].plugin == "fv-cmdgood"  # first by distribution name keeps it
    messages = sorted(str(c) for c in found.conflicts)
    assert all(isinstance(c, PluginCommandConflict) for c in found.conflicts)
    assert messages == [
        "plugin fv-cmdshadow's command 'hello' is refused: plugin fv-cmdgood already provides 'fv hello'",
        "plugin fv-cmdshadow's command 'serve' is refused: it would shadow the kernel command 'fv serve'",
    ]
    result = runner.invoke(app, ["serve", "-h"])
    assert result.exit_code == 0 and "OpenAI-style video API" in result.stdout and "shadowed" not in result.output
    # Negative control: without the kernel's names, the plugin's serve would be offered.
    assert "serve" in discover_plugin_commands(set()).commands


@pytest.mark.parametrize(("args", "expected"), [
    (["explode"], "fv: fv explode: plugin fv-cmdbroken is broken: importing fv_cmdbroken.cli:run raised "
                  "RuntimeError: fv_cmdbroken exploded at import"),
    (["old"], "fv: fv old: plugin fv-cmdold cannot load: plugin 'fv-cmdold' requires kernel API '>=3.0,<4'"),
    (["badtarget"], "fv: fv badtarget: plugin fv-cmdbadyaml's manifest is invalid:"),
])
def test_a_broken_plugins_command_is_refused_in_one_line(site: Path, args: list[str], expected: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr


def test_a_disabled_plugins_command_is_refused(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FV_PLUGINS", "fv-cmdbroken")  # enables exactly that one: fv-cmdgood is off
    result = runner.invoke(app, ["hello"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "fv: fv hello: plugin fv-cmdgood is not enabled (autoload is off); enable it (FV_PLUGINS) to use its commands"
    )
    assert "fv_cmdgood.cli" not in sys.modules
    # Negative control: enabled, it runs.
    monkeypatch.setenv("FV_PLUGINS", "fv-cmdgood")
    assert runner.invoke(app, ["hello"]).stdout.strip() == "hello world"


def test_fv_help_imports_neither_torch_nor_the_plugin(site: Path) -> None:
    script = (
        "import sys\nfrom fv_kernel.cli.app import main\nsys.argv = ['fv', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {PACKAGES!r} or m == 'torch'), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env={**_env(), "PYTHONPATH": str(site)},
    )
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr
    assert "hello" in done.stdout


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "FV_PLUGINS"}


def test_plugins_list_shows_declared_commands(site: Path) -> None:
    result = runner.invoke(app, ["plugins", "list"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    good = next(i for i, line in enumerate(lines) if line.startswith("fv-cmdgood 0.1.0"))
    assert "    commands: fv hello, fv toolbox" in lines[good + 1 : good + 3]
    assert "    commands: fv explode" in lines  # a broken command's plugin still lists it (manifest only)
    kernel = next(i for i, line in enumerate(lines) if line.startswith("fv-kernel "))
    block = lines[kernel + 1 : next((i for i in range(kernel + 1, len(lines)) if not lines[i].startswith("    ")), len(lines))]
    assert block and not any(line.startswith("    commands:") for line in block)  # none declared, no line
    rows = {row["name"]: row for row in json.loads(runner.invoke(app, ["plugins", "list", "--json"]).stdout)}
    assert rows["fv-cmdgood"]["commands"] == {
        "hello": {"target": "fv_cmdgood.cli:hello", "summary": "Say hello from a plugin."},
        "toolbox": {"target": "fv_cmdgood.cli:toolbox_app", "summary": "A group of plugin tools."},
    }
    assert rows["fv-kernel"]["commands"] == {}
    assert not any(name in sys.modules for name in ("fv_cmdgood.cli", "fv_cmdbroken.cli"))  # listed, not imported


def test_plugins_check_imports_each_command_target(site: Path) -> None:
    good = runner.invoke(app, ["plugins", "check", "fv-cmdgood", "--no-side-effects"])
    assert good.exit_code == 0, good.output
    assert "  ok   commands" in good.stdout
    broken = runner.invoke(app, ["plugins", "check", "fv-cmdbroken", "--no-side-effects"])
    assert broken.exit_code == 1
    assert "FAIL commands" in broken.stdout
    assert ("command 'explode': importing target fv_cmdbroken.cli:run raised RuntimeError: "
            "fv_cmdbroken exploded at import") in broken.stdout
    odd = runner.invoke(app, ["plugins", "check", "fv-cmdnotcallable", "--no-side-effects"])
    assert odd.exit_code == 1
    assert "command 'number': target fv_cmdnotcallable.cli:NUMBER is a int, not a typer.Typer or a function" in odd.stdout
    assert "command 'missing': importing target fv_cmdnotcallable.cli:nowhere raised AttributeError" in odd.stdout


def test_check_commands_negative_control(site: Path) -> None:
    # The same plugin with its target fixed passes: the failures above come from the targets alone.
    from fv_kernel.plugins.check import PluginChecker

    assert PluginChecker("fv-cmdgood").check_commands() == []
    problems = PluginChecker("fv-cmdnotcallable").check_commands()
    assert len(problems) == 2 and all(p.startswith("command '") for p in problems)
