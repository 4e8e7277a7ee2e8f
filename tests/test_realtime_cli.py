"""``fv realtime`` (docs/realtime.md, "Sessions" > CLI) and the façade's ``session()`` on the toy-chunk card."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import fv_kernel as fv
from fv_kernel.api import Chunk, InvalidRequest, SessionClosed, StepFailed
from fv_kernel.cli.app import LAZY_COMMANDS, app
from fv_kernel.plugins import PluginHost
from fv_kernel.testing.chunk_kit import chunk_toy_card
from fv_kernel.testing.toy import toy_card

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture
def card(tmp_path: Path) -> str:
    path = tmp_path / "toy-chunk.json"
    path.write_text(chunk_toy_card().model_dump_json())
    return str(path)


def reference_chunks(card: str, host: PluginHost, n: int, **opts: Any) -> list[Chunk]:
    with fv.load(card, host=host).session("a red fox", max_chunks=n, seed=5, **opts) as s:
        return list(s)


# -- façade ----------------------------------------------------------------------------------------


def test_facade_session_yields_typed_chunks_and_applies_updates_at_a_boundary(card: str, fv_host: PluginHost) -> None:
    gen = fv.load(card, host=fv_host)
    # Enough chunks that the stream is still running when the update sent after chunk 0 lands: with 5, a busy
    # CI machine once let the toy session finish every chunk before the consumer's update reached it.
    chunks = 12
    reference = reference_chunks(card, fv_host, chunks)
    got: list[Chunk] = []
    with gen.session("a red fox", max_chunks=chunks, seed=5) as s:
        for chunk in s:
            got.append(chunk)
            if chunk.index == 0:
                assert s.update("a blue bird") == 1
    assert s.close_reason == "completed"
    assert [c.index for c in got] == list(range(chunks)) and all(isinstance(c, Chunk) for c in got)
    assert got[0].frames.shape == (2, 3, 8, 8) and got[1].pts == (0.25, 0.5) and got[1].fps == 8.0
    versions = [c.prompt_version for c in got]
    first = versions.index(1)
    assert versions == [0] * first + [1] * (chunks - first) and first >= 1
    applied = [e for e in s.events if e.type == "session.prompt_applied"]
    assert [(e.version, e.chunk_index) for e in applied] == [(1, first)]
    for before in got[:first]:
        assert torch.equal(before.frames, reference[before.index].frames), "chunks before the boundary see the old prompt"
    assert not torch.equal(got[first].frames, reference[first].frames)


def test_facade_session_stop_and_errors(card: str, fv_host: PluginHost, tmp_path: Path) -> None:
    gen = fv.load(card, host=fv_host)
    with gen.session("a red fox") as s:  # unbounded: runs until stop
        for chunk in s:
            if chunk.index == 2:
                s.stop()
    assert s.close_reason == "stopped"
    with pytest.raises(SessionClosed):
        s.update("too late")
    for late in (s.touch, lambda: s.cancel("stream"), s.suspend):
        with pytest.raises(SessionClosed):
            late()
    s.stop()  # nothing to stop: no error
    with gen.session("a red fox") as s:
        for chunk in s:
            break  # leaving the block stops it
    assert s.close_reason == "stopped"
    with pytest.raises(InvalidRequest) as err:
        gen.session("x", max_chunks=0)
    assert err.value.param == "max_chunks"
    with pytest.raises(InvalidRequest) as err:
        gen.session("x", colour="red")
    assert err.value.param == "colour"
    with pytest.raises(StepFailed, match="toy fault"):
        with gen.session("boom", max_chunks=2) as failing:
            list(failing)
    dit = tmp_path / "toy-dit.json"
    dit.write_text(toy_card("toy-dit").model_dump_json())
    with pytest.raises(InvalidRequest) as err:
        with fv.load(str(dit), host=fv_host).session("x"):
            pass
    assert err.value.param == "model"


# -- CLI -------------------------------------------------------------------------------------------


def realtime(*args: str, input: str = "") -> Any:
    return CliRunner().invoke(app, ["realtime", *args], input=input)


def test_the_root_lists_realtime() -> None:
    assert "realtime" in LAZY_COMMANDS


def test_fv_realtime_writes_the_stream_to_an_mp4_and_shows_progress(card: str, tmp_path: Path) -> None:
    out = tmp_path / "out.mp4"
    result = realtime("--model", card, "--prompt", "a red fox", "--chunks", "3", "--output", str(out))
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("chunk ")]
    assert len(lines) == 3
    assert re.match(r"chunk 0  frames 0-1  [\d.]+ FPS  latency \d+ ms  prompt v0$", lines[0]), lines[0]
    assert "wrote" in result.stderr and "6 frames" in result.stderr and "completed" in result.stderr
    import av

    with av.open(str(out)) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 6 and (frames[0].width, frames[0].height) == (8, 8)


def test_fv_realtime_pt_output_equals_the_facade_session(card: str, tmp_path: Path, fv_host: PluginHost) -> None:
    out = tmp_path / "out.pt"
    result = realtime("--model", card, "--prompt", "a red fox", "--chunks", "4", "--seed", "5", "-q", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert not [line for line in result.stderr.splitlines() if line.startswith("chunk ")], "-q: no progress lines"
    frames = torch.load(out, weights_only=True)
    expected = torch.cat([c.frames for c in reference_chunks(card, fv_host, 4)])
    assert torch.equal(frames, expected)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--output", "x.avi"], "unsupported suffix '.avi'"),
        (["--chunks", "0", "--output", "x.pt"], "'--chunks'"),
        (["--fps", "-1", "--output", "x.pt"], "fps"),
    ],
)
def test_fv_realtime_refuses_bad_input_in_one_line_and_writes_nothing(card: str, tmp_path: Path, args: list[str], message: str) -> None:
    args = [a if not a.startswith("x.") else str(tmp_path / a) for a in args]
    result = realtime("--model", card, "--prompt", "a red fox", *args)
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("x.*"))


def test_fv_realtime_refuses_a_card_that_cannot_stream(tmp_path: Path) -> None:
    dit = tmp_path / "toy-dit.json"
    dit.write_text(toy_card("toy-dit").model_dump_json())
    result = realtime("--model", str(dit), "--prompt", "x", "--output", str(tmp_path / "o.mp4"))
    assert result.exit_code == 2 and "model:" in result.stderr and "chunk_rollout" in result.stderr
    assert "allowed:" in result.stderr  # the installed causal cards (fv-wan's test checks wan-toy-causal is named)
    assert not (tmp_path / "o.mp4").exists()


def test_a_line_typed_on_stdin_while_it_runs_updates_the_prompt(card: str, tmp_path: Path) -> None:
    """A real process: type a prompt once chunks stream, see it applied at a chunk boundary, then ':stop'."""
    out = tmp_path / "live.pt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fv_kernel.cli.app", "realtime", "--model", card, "--prompt", "a red fox", "--seed", "5",
         "--output", str(out)],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdin is not None and proc.stderr is not None
    timer = threading.Timer(120, proc.kill)  # never hang the suite
    timer.start()
    seen: list[str] = []
    try:
        for line in proc.stderr:
            seen.append(line.rstrip("\n"))
            if line.startswith("chunk 1 "):
                proc.stdin.write("a blue bird\n")
                proc.stdin.flush()
            if line.startswith("prompt v1 applied"):
                proc.stdin.write(":stop\n")
                proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        timer.cancel()
    stderr = "\n".join(seen)
    assert proc.returncode == 0, stderr
    assert "prompt v1 queued: a blue bird" in stderr and "session stopped" in stderr
    applied = int(re.search(r"prompt v1 applied from chunk (\d+)", stderr).group(1))  # type: ignore[union-attr]
    versions = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"^chunk (\d+) .* prompt v(\d+)$", stderr, re.M)}
    assert applied >= 2 and all(v == (1 if i >= applied else 0) for i, v in versions.items()), versions
    frames = torch.load(out, weights_only=True)
    assert frames.shape[0] == 2 * len(versions)


def test_reading_chunks_keeps_a_facade_session_alive_past_its_idle_timeout(card: str, fv_host: PluginHost) -> None:
    import time

    started = time.monotonic()
    with fv.load(card, host=fv_host).session("a red fox", idle_timeout_s=1.0) as s:  # unbounded: paced by the reads
        for chunk in s:
            time.sleep(0.4)  # 6 chunks at 0.4 s: well past 1 s, but every read is activity
            if chunk.index == 5:
                s.stop()
    assert s.close_reason == "stopped" and time.monotonic() - started > 2.0


def test_negative_control_without_the_touch_on_read_the_idle_timeout_ends_it(
    card: str, fv_host: PluginHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from fv_kernel.runtime.sessions import SessionHandle

    monkeypatch.setattr(SessionHandle, "touch", lambda self: None)
    with fv.load(card, host=fv_host).session("a red fox", idle_timeout_s=1.0) as s:
        for chunk in s:
            time.sleep(0.4)
            if chunk.index == 5:
                s.stop()
    assert s.close_reason == "idle_timeout"


def test_ctrl_c_stops_the_stream_and_keeps_what_was_made(card: str, tmp_path: Path) -> None:
    import signal

    out = tmp_path / "cc.pt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fv_kernel.cli.app", "realtime", "--model", card, "--prompt", "x", "--output", str(out)],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("chunk 2 "):
            proc.send_signal(signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=120)
    stderr = "".join(seen) + rest
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    assert "session stopped" in stderr
    made = len(re.findall(r"^chunk \d+ ", stderr, re.M))
    frames = torch.load(out, weights_only=True).shape[0]  # plus any chunk finished while stopping
    assert frames % 2 == 0 and frames >= 2 * made >= 6
