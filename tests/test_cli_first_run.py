"""A new user's first run of ``fv``: bad input is refused before any compute with one line,
the card's declared bounds are enforced in the one place requests are resolved, the CLI is
light and polite (``-h``, no torch for ``fv --help``, 80 columns), and the README's commands
are the ones CI runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fv_kernel.card.spec import CapabilityMatrix, ModelCard, TokenGridRule
from fv_kernel.model.validate import resolve_request
from fv_kernel.errors import InvalidRequest
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.testing.toy import toy_card

ROOT = Path(__file__).resolve().parents[1]


def card_with(model_id: str = "toy-dit", **capabilities: Any) -> ModelCard:
    """A toy card whose capabilities carry ``capabilities`` (validated as a card file would be)."""
    data = json.loads(toy_card(model_id).model_dump_json())
    data["capabilities"].update(capabilities)
    return ModelCard.model_validate(data)


def t2v(card: ModelCard, prompt: str = "a red fox", **diffusion: Any) -> Request:
    return Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
                   diffusion=DiffusionParams(**diffusion))


# --------------------------------------------------------------------------- card bounds in resolve_request


def test_steps_beyond_the_cards_maximum_are_refused_naming_it() -> None:
    card = card_with(max_steps=50)
    with pytest.raises(InvalidRequest) as info:
        resolve_request(card, t2v(card, steps=100000))
    assert info.value.param == "steps" and info.value.message.endswith("allowed: 1..50")
    assert resolve_request(card, t2v(card, steps=50)).diffusion.steps == 50
    # Negative control: a card that declares no maximum takes any count.
    unbounded = card_with()
    assert resolve_request(unbounded, t2v(unbounded, steps=100000)).diffusion.steps == 100000


def test_fps_outside_the_cards_range_is_refused() -> None:
    card = card_with(min_fps=1.0, max_fps=60.0)
    for fps in (0.0001, 61.0):
        with pytest.raises(InvalidRequest, match=r"^fps: .* allowed: 1\.\.60$"):
            resolve_request(card, t2v(card, fps=fps))
    assert resolve_request(card, t2v(card, fps=60.0)).diffusion.fps == 60.0
    unbounded = card_with()
    assert resolve_request(unbounded, t2v(unbounded, fps=0.0001)).diffusion.fps == 0.0001


def test_a_size_beyond_the_token_grid_is_refused_by_axis() -> None:
    # toy-dit: spatial multiple 8, frames 2k+1; a table of 4 positions per axis.
    rule = {"max_per_axis": 4, "frames_per_latent": 2, "pixels_per_token": 8}
    card = card_with(token_grid=rule)
    assert TokenGridRule(**rule).max_side == 32 and TokenGridRule(**rule).max_frames == 7
    for field, asked, allowed in (("height", {"height": 40}, 32), ("width", {"width": 40}, 32), ("frames", {"frames": 9}, 7)):
        with pytest.raises(InvalidRequest) as info:
            resolve_request(card, t2v(card, **asked))
        assert info.value.param == field and f"allowed: {field} <= {allowed}" in info.value.message
        assert "beyond its positional table of 4 per axis" in info.value.message
    resolved = resolve_request(card, t2v(card, height=32, width=32, frames=7))
    assert (resolved.diffusion.height, resolved.diffusion.width, resolved.diffusion.frames) == (32, 32, 7)
    unbounded = card_with()
    assert resolve_request(unbounded, t2v(unbounded, height=40)).diffusion.height == 40


def test_a_card_whose_defaults_break_its_own_bounds_does_not_validate() -> None:
    for bad in ({"max_steps": 3}, {"min_fps": 10.0}, {"max_fps": 4.0},
                {"token_grid": {"max_per_axis": 1, "pixels_per_token": 8}}, {"min_fps": 9.0, "max_fps": 2.0}):
        with pytest.raises(ValidationError):
            card_with(**bad)
    card_with(max_steps=4, min_fps=8.0, max_fps=8.0)  # the toy defaults: 4 steps at 8 fps


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_an_empty_prompt_is_refused_for_tasks_that_need_text(prompt: str) -> None:
    card = toy_card("toy-dit")
    with pytest.raises(InvalidRequest, match=r"^prompt: task 'text_to_video' needs a prompt"):
        resolve_request(card, t2v(card, prompt))
    lm = toy_card("toy-lm")
    with pytest.raises(InvalidRequest, match=r"^prompt: task 'text_generation' needs a prompt"):
        resolve_request(lm, Request(model="toy-lm", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text=prompt),)))


def test_prompt_upsampling_needs_a_card_with_a_reasoner() -> None:
    dit = toy_card("toy-dit")
    with pytest.raises(InvalidRequest, match=r"^prompt_upsampling: card 'toy-dit' has no reasoner"):
        resolve_request(dit, t2v(dit).with_updates(prompt_upsampling=True))
    omni = toy_card("toy-omni")
    assert resolve_request(omni, t2v(omni).with_updates(prompt_upsampling=True)).prompt_upsampling


# --------------------------------------------------------------------------- fv generate: refused before compute, one line

from typer.testing import CliRunner  # noqa: E402

from fv_kernel.cli import generate_cmd  # noqa: E402
from fv_kernel.cli.app import LAZY_COMMANDS, app, load_command  # noqa: E402


@pytest.fixture
def no_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if fv generate builds a model (every refusal here must come first)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was built before the input was refused")

    monkeypatch.setattr(generate_cmd, "build_instance", refuse)
    monkeypatch.setattr(generate_cmd, "preflight", refuse)


def card_file(tmp_path: Path, **capabilities: Any) -> str:
    path = tmp_path / "card.json"
    path.write_text(card_with(**capabilities).model_dump_json())
    return str(path)


def generate(*args: str) -> Any:
    return CliRunner().invoke(app, ["generate", *args])


def one_error_line(result: Any) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_bad_output_paths_are_refused_before_the_plugins_even_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_compute: None
) -> None:
    monkeypatch.setattr(generate_cmd, "start_host", lambda *a: pytest.fail("started plugins before checking --output"))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = {
        str(tmp_path / "x.webm"): "output: unsupported suffix '.webm'",
        str(a_file / "out.mp4"): "is not a directory",
        "/proc/fv-out/out.mp4": "output: cannot create files in '/proc'",
        str(tmp_path): "output: unsupported suffix '(none)'",
    }
    if os.geteuid() != 0:  # root writes anywhere: permissions cannot refuse it
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases[str(locked / "out.mp4")] = "output: cannot create files in"
    for output, expected in cases.items():
        line = one_error_line(generate("--model", "no-such-card", "--prompt", "x", "--output", output))
        assert expected in line, (output, line)


def test_devices_are_checked_before_anything_is_built(tmp_path: Path, no_compute: None) -> None:
    model = card_file(tmp_path)
    line = one_error_line(generate("--model", model, "--prompt", "x", "--device", "tpu", "--output", str(tmp_path / "o.pt")))
    assert line.startswith("error: device: 'tpu' is not a torch device; allowed: cpu, cuda")
    import torch

    if not torch.cuda.is_available():
        line = one_error_line(generate("--model", model, "--prompt", "x", "--device", "cuda", "--output", str(tmp_path / "o.pt")))
        assert line == "error: device: 'cuda': CUDA is not available on this machine; allowed: cpu"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--steps", "100000"], "error: steps: 100000 exceeds the maximum of card 'toy-dit'; allowed: 1..50"),
        (["--prompt", "   "], "error: prompt: task 'text_to_video' needs a prompt; it is empty; allowed: non-blank text"),
        (["--height", "40"], "allowed: height <= 32"),
        (["--upsample-prompt"], "error: prompt_upsampling: card 'toy-dit' has no reasoner (an ar_decode loop)"),
    ],
)
def test_requests_beyond_the_card_are_one_line_before_compute(
    tmp_path: Path, no_compute: None, flags: list[str], expected: str
) -> None:
    model = card_file(tmp_path, max_steps=50, token_grid={"max_per_axis": 4, "frames_per_latent": 2, "pixels_per_token": 8})
    args = ["--model", model, "--output", str(tmp_path / "o.pt")]
    if "--prompt" not in flags:
        args += ["--prompt", "a red fox"]
    assert expected in one_error_line(generate(*args, *flags))
    assert not (tmp_path / "o.pt").exists()


def test_upsample_refusal_names_the_installed_cards_that_can(fv_host: Any, register_plugin: Any) -> None:
    class Cards:
        from fv_kernel.plugins.hookspecs import hookimpl

        @hookimpl
        def fv_register_model_cards(self, register: Any) -> None:
            register("toy-dit", toy_card("toy-dit"))
            register("toy-omni", toy_card("toy-omni"))

    register_plugin(Cards(), name="fv-toys")
    assert generate_cmd._cards_that_upsample(fv_host) == "; cards with a reasoner: toy-omni (loop upsample)"


# --------------------------------------------------------------------------- progress and Ctrl-C


class _Terminal:
    """A stream that says it is a terminal."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def _drive(progress: Any) -> None:
    with progress.loading("toy-dit") as loading:
        loading.validated("toy-dit")
    for stage, total in (("text_encode", 1), ("denoise", 4), ("decode", 3)):
        for step in range(1, total + 1):
            progress.update(stage, step, total)
    progress.close()


def test_progress_off_a_terminal_is_plain_lines_one_per_stage() -> None:
    from io import StringIO

    from fv_kernel.io.progress import StageProgress

    log = StringIO()
    _drive(StageProgress(True, log))
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0] == "loading toy-dit..." and re.fullmatch(r"loaded toy-dit in \d\d:\d\d", lines[1])
    assert [line.split(":")[0].strip() for line in lines[2:]] == ["text_encode", "denoise", "decode"]
    assert re.fullmatch(r"\s*denoise: 4/4 steps in \d\d:\d\d \(.*step.*\)", lines[3]), lines[3]
    # Negative control: on a terminal tqdm redraws its lines with carriage returns, which the check above catches.
    terminal = _Terminal()
    _drive(StageProgress(True, terminal))
    assert "\r" in terminal.text and "loading toy-dit" in terminal.text
    assert re.search(r"denoise: 100%\|.*\| 4/4 \[\d\d:\d\d<\d\d:\d\d, .*step", terminal.text)  # elapsed, ETA, rate


def test_generate_writes_a_file_with_plain_progress_lines(tmp_path: Path) -> None:
    out = tmp_path / "o.pt"
    result = CliRunner().invoke(app, ["generate", "--model", card_file(tmp_path), "--prompt", "a red fox", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and "\r" not in result.output
    stages = [line.split(":")[0].strip() for line in result.stderr.splitlines()]
    assert stages[:2] == ["loading toy-dit...", "loaded toy-dit in 00"] or stages[0] == "loading toy-dit..."
    assert {"text_encode", "denoise", "decode"} <= set(stages)
    quiet = CliRunner().invoke(app, ["generate", "--model", card_file(tmp_path), "--prompt", "x", "-q", "--output", str(out)])
    assert quiet.exit_code == 0 and quiet.stderr == ""


@pytest.mark.parametrize("interrupt_after", ["loading toy-dit...", "loaded toy-dit"])
def test_ctrl_c_exits_130_with_one_line(tmp_path: Path, interrupt_after: str) -> None:
    """Ctrl-C at start-up (while the model builds) or during generation: exit 130, one line, no traceback."""
    import signal

    model = card_file(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fv_kernel.cli.app", "generate", "--model", model, "--prompt", "x", "--steps", "100000",
         "--output", str(tmp_path / "o.pt")],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(interrupt_after):
            proc.send_signal(signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=300)
    stderr = "".join(seen) + rest
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and stderr.rstrip().splitlines()[-1] == "fv: interrupted"
    assert not (tmp_path / "o.pt").exists()


_INTERRUPT_INSIDE_THE_LOOP = """
import asyncio, sys
from typing import Any
from fv_kernel.cli import generate_cmd
from fv_kernel.cli.app import interrupted


class Stubborn:
    \"\"\"An engine whose background task fails while asyncio.run shuts down, and whose request's
    event stream is where Ctrl-C lands (KeyboardInterrupt raised inside the running loop).\"\"\"

    def running(self) -> Any:
        import contextlib

        @contextlib.asynccontextmanager
        async def ctx() -> Any:
            async def background() -> None:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    raise RuntimeError("failed while cancelled") from None

            self.task = asyncio.get_running_loop().create_task(background())
            await asyncio.sleep(0)
            yield self

        return ctx()

    def submit(self, request: Any) -> Any:
        return self

    async def events(self) -> Any:
        raise KeyboardInterrupt
        yield


class Progress:
    def update(self, *args: Any) -> None: ...
    def close(self) -> None: ...


if sys.argv[1] == "asyncio.run":  # negative control: the plain asyncio.run the command used before
    generate_cmd._run_until_interrupted = asyncio.run
try:
    try:
        generate_cmd._run(Stubborn(), None, Progress())
    except KeyboardInterrupt:
        interrupted()
except typer.Exit as exc:
    sys.exit(exc.exit_code)
"""


def _interrupt_inside_the_loop(mode: str) -> subprocess.CompletedProcess[str]:
    script = "import typer\n" + _INTERRUPT_INSIDE_THE_LOOP
    return subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120)


def test_ctrl_c_inside_the_event_loop_leaves_one_line_whatever_asyncio_logs_at_shutdown() -> None:
    """asyncio.run's shutdown logs a task that fails while cancelled (with its traceback), and a task
    destroyed while pending at exit; after Ctrl-C fv says one line and nothing else (CI saw the
    second after 'fv: interrupted', once in ~60 runs of the test above)."""
    done = _interrupt_inside_the_loop("fv")
    assert done.returncode == 130 and done.stderr.strip().splitlines() == ["fv: interrupted"], done.stderr
    # Negative control: with plain asyncio.run the shutdown's log reaches the terminal.
    plain = _interrupt_inside_the_loop("asyncio.run")
    assert plain.returncode == 130 and "Traceback" in plain.stderr and "failed while cancelled" in plain.stderr, plain.stderr


# --------------------------------------------------------------------------- CLI polish


def _run_fv(*args: str) -> subprocess.CompletedProcess[str]:
    script = (
        "import sys\nfrom fv_kernel.cli.app import main\n"
        f"sys.argv = ['fv', *{list(args)!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr)\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


def test_fv_help_does_not_import_torch() -> None:
    for args in (["--help"], ["-h"], [], ["version"]):
        done = _run_fv(*args)
        assert done.stderr.strip().splitlines()[-1] == "torch not imported", (args, done.stderr)
    help_text = _run_fv("--help").stdout
    for name in LAZY_COMMANDS:
        assert name in help_text
    # Negative control: running a command does import torch, so the check above can see it.
    assert _run_fv("cards", "list").stderr.strip().splitlines()[-1] == "torch imported"


def test_the_roots_summaries_are_the_commands_own() -> None:
    for name, lazy in LAZY_COMMANDS.items():
        command = load_command(name)
        assert command.help is not None and " ".join(command.help.split("\n\n")[0].split()) == lazy.summary, name


def _command_paths() -> list[list[str]]:
    paths: list[list[str]] = [[]]
    for name in sorted({*LAZY_COMMANDS, "version"}):
        command = load_command(name) if name in LAZY_COMMANDS else None
        paths.append([name])
        if hasattr(command, "list_commands"):  # a group: its sub-commands too
            paths.extend([name, sub] for sub in command.list_commands(None))
    return paths


def test_dash_h_works_everywhere() -> None:
    paths = _command_paths()
    assert ["cards", "list"] in paths and ["plugins", "check"] in paths and ["generate"] in paths
    for path in paths:
        result = CliRunner().invoke(app, [*path, "-h"])
        assert result.exit_code == 0 and "Usage:" in result.output, (path, result.output)


def test_cards_list_fits_80_columns(fv_host: Any, register_plugin: Any) -> None:
    from fv_kernel.cli.cards_cmd import _table

    every_task = sorted(t.value for t in TaskType)
    rows = [
        {"model_id": "a-long-card-id-v2.1-14b", "family": "toy", "recipe": "dmd2 (assumes loop dmd_3step) from "
         "a-very-long-parent-card-name-that-goes-on-and-on-and-on", "tasks": every_task, "parity": "C1", "plugin": "fv-somewhere"},
        {"model_id": "toy-dit", "family": "toy", "recipe": "base", "tasks": ["text_to_video"], "parity": "C1", "plugin": "fv-toys"},
    ]
    lines = _table(rows, 80)
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = " ".join(" ".join(lines).split())
    assert all(task in text for task in every_task) and "from a-very-long-parent-card-name-that-goes-on-and-on-and-on" in text
    # and the command itself, at 80 columns
    result = CliRunner().invoke(app, ["cards", "list"], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and max(len(line) for line in result.output.splitlines()) <= 80, result.output


@pytest.mark.parametrize("flags", [[], ["--no-side-effects"]], ids=["as-the-issue-ran-it", "no-side-effects"])
def test_plugins_check_of_a_missing_plugin_is_one_error_line(flags: list[str]) -> None:
    result = CliRunner().invoke(app, ["plugins", "check", "nosuch", *flags])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith("error: no 'fv.plugins' entry point for distribution 'nosuch'; installed plugins: ")


# --------------------------------------------------------------------------- README, CI and docs


def _readme_quickstart(readme: str) -> list[str]:
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```\n(.*?)```", section, flags=re.S)]


def _print_quickstart(readme: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-quickstart", str(readme)],
                          capture_output=True, text=True, timeout=60)


def test_ci_runs_the_readmes_two_quickstart_commands(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = _readme_quickstart(readme)
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    install, tests = commands
    assert "pip install" in install and "fv generate" in install and install.endswith(".mp4")
    assert tests.split("&&")[-1].split()[0] == "tox"  # CI appends tox options to it
    done = _print_quickstart(ROOT / "README.md")
    assert done.returncode == 0 and done.stdout.splitlines() == commands, done.stderr
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install" not in ci and "tox -p" not in ci  # nothing CI runs is written there instead
    # Negative controls: a Quickstart with a third command, or with one, is refused, not half-run.
    for blocks in (commands + ["echo extra"], commands[:1]):
        broken = readme.split("## Quickstart", 1)[0] + "## Quickstart\n\n" + "".join(f"```\n{b}\n```\n\n" for b in blocks)
        broken += "## Use it\n"
        path = tmp_path / "README.md"
        path.write_text(broken, encoding="utf-8")
        refused = _print_quickstart(path)
        assert refused.returncode != 0 and "exactly two command blocks" in refused.stderr


def test_the_readmes_cpu_only_install_advice_holds() -> None:
    """What the README tells a CPU-only user: install the CPU build from PyTorch's index first and
    pip keeps it for the Quickstart's pin; for tox, PIP_EXTRA_INDEX_URL reaches every env's pip."""
    import configparser

    from packaging.specifiers import SpecifierSet

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install, tests = _readme_quickstart(readme)
    pin = re.search(r"torch==([0-9.]+)", install)
    assert pin is not None and f"torch=={pin.group(1)} " in tests + " ", "both commands pin one torch"
    version = pin.group(1)
    assert f"pip install torch=={version} --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in readme
    # PEP 440: '==X' ignores a local label, so the installed X+cpu satisfies the Quickstart's pin ...
    assert SpecifierSet(f"=={version}").contains(f"{version}+cpu")
    # ... (negative control: an exact '===' pin would not, and pip would fetch the CUDA build)
    assert not SpecifierSet(f"==={version}").contains(f"{version}+cpu")
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini", encoding="utf-8")
    assert "PIP_*" in [v.strip() for v in tox["testenv"]["passenv"].split(",")], "tox must pass PIP_* to each env's pip"
    assert f"torch=={version}" in tox["testenv"]["deps"].split(), "tox's envs install the README's torch"


def _references_outside_the_repository(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line target`` for each mention of the session's shared folder and each relative
    markdown link that leaves ``root`` or names no file."""
    found = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        found += [f"{path.name}:{n} {m}" for m in re.findall(r"(?:\.\./)+shared/\S*|/work/\S*", line)]
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            local = target.split("#")[0]
            if not local or re.match(r"^[a-z][a-z0-9+.-]*:", local):  # an anchor or a URL
                continue
            resolved = (path.parent / local).resolve()
            if not resolved.is_relative_to(root) or not resolved.exists():
                found.append(f"{path.name}:{n} {target}")
    return found


def test_docs_reference_no_file_outside_the_repository(tmp_path: Path) -> None:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "docs").rglob("*.py")),
             *sorted(ROOT.glob("plugins/*/README.md")), *sorted(ROOT.glob("plugins/*/*/README.md"))]
    assert any("plugins" in p.parts for p in paths), "the plugins' READMEs are checked too"
    offending = [hit for p in paths for hit in _references_outside_the_repository(p)]
    assert not offending, offending
    # Negative control: the check sees a link out of the repository, a missing file and the shared folder named.
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "there.md").write_text("x")
    doc = repo / "docs" / "a.md"
    doc.write_text("[ok](there.md#part) [web](https://example.com/x) [top](#a)\n[seed](../../shared/seeds/000.txt)\n"
                   "[gone](missing.md)\nsee /work/shared/reference/x.md\n")
    assert len(_references_outside_the_repository(doc, repo)) == 4, _references_outside_the_repository(doc, repo)


def test_docs_examples_name_only_test_files_that_exist() -> None:
    for example in sorted((ROOT / "docs" / "examples").glob("*.py")):
        for name in re.findall(r"(?:tests|plugins/[\w-]+/tests)/[\w/]+\.py", example.read_text(encoding="utf-8")):
            assert (ROOT / name).is_file(), f"{example.name} names {name}, which does not exist"
