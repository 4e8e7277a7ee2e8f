"""``fv train``'s progress (``run_training`` drawing through ``fv_kernel.io.progress.StageProgress``, the
code ``fv generate`` uses): off a terminal (a log file, a pipe) plain lines and never a carriage
return -- one every tenth of a stage (step/total, elapsed, ETA, rate, the latest losses) and one at
its end, also when the stage stops early; on a terminal a live tqdm bar with the losses; nothing
with ``progress=False`` (``--quiet``). A fake method and a fake family stand in for real ones."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from fv_kernel.api import ModelCard, ParityResult, RecipeSpec, hookimpl
from fv_kernel.plugins import PluginHost
from fv_kernel.testing.toy import toy_card
from fv_kernel.training import RLMethod, TrainedModel, TrainingRun
from fv_kernel.training.recipe import TrainingRecipe
from fv_kernel.training import runner
from fv_kernel.training.runner import PROGRESS_LINES_PER_STAGE, run_training

FULL, STOPPED_AT, TOTAL = 100, 37, 100


class _Method(RLMethod):
    """Reports a stage of 100 steps, then a stage of 100 that stops after 37 (a wall-clock budget)."""

    name = "progress-probe"

    def loss(self, batch: dict[str, Any]) -> Any:
        raise NotImplementedError  # train() below does not call it

    def train(self, run: TrainingRun) -> TrainedModel:
        for step in range(1, FULL + 1):
            run.report("dit", step, TOTAL, {"loss": 1.0 / step, "aux": 0.5})
        for step in range(1, STOPPED_AT + 1):
            run.report("vae", step, TOTAL, {"recon": 2.0 / step})
        return TrainedModel(modules={}, recipe=RecipeSpec(method=self.name, parents=("toy-dit",)),
                            steps={"dit": FULL, "vae": STOPPED_AT})


class _Plugin:
    @hookimpl
    def fv_register_rl_methods(self, register: Any) -> None:
        register(_Method.name, _Method)

    @hookimpl
    def fv_export_checkpoint(self, card: ModelCard, modules: dict, directory: Path) -> ModelCard | None:
        directory.mkdir(parents=True)
        (directory / "weights.json").write_text(json.dumps(sorted(modules)))
        return card

    @hookimpl
    def fv_check_parity(self, card: ModelCard, directory: Path) -> ParityResult | None:
        return ParityResult("reference==1", "loop_vs_reference", "max_abs", 0.0, 1e-5)


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stderr: Any, *, progress: bool = True) -> None:
    tmp_path.mkdir(parents=True, exist_ok=True)
    card = tmp_path / "card.json"
    card.write_text(toy_card("toy-dit").model_dump_json())
    host = PluginHost(discover=False)
    host.register(_Plugin(), name="progress-probe")
    recipe = TrainingRecipe(method=_Method.name, card=str(card), output_model_id="toy-trained", device="cpu")
    # Progress only: no loss curves, so the kernel env needs no matplotlib (fv train's extra).
    monkeypatch.setattr(runner, "_require_extras", lambda: None)
    monkeypatch.setattr(runner, "write_loss_curves", lambda log, output: None)
    monkeypatch.setattr(sys, "stderr", stderr)  # where fv train draws, as the CLI runs it
    run_training(recipe, tmp_path / "run", host, progress=progress)


@pytest.fixture(params=["stringio", "pipe"])
def log_stream(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """A stream that is not a terminal, and how to read what was written to it."""
    if request.param == "stringio":
        stream = io.StringIO()
        yield stream, stream.getvalue
        return
    read_end, write_end = os.pipe()  # a real pipe (`fv train 2>&1 | tee log`); the lines fit its buffer
    writer = os.fdopen(write_end, "w")
    reader = os.fdopen(read_end)

    def read() -> str:
        writer.close()
        return reader.read()

    try:
        yield writer, read
    finally:
        writer.close()
        reader.close()


def test_off_a_terminal_plain_lines_every_tenth_and_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_stream: tuple[Any, Any]
) -> None:
    stream, read = log_stream
    assert not stream.isatty()
    _train(tmp_path, monkeypatch, stream)
    text = read()
    assert "\r" not in text, text
    lines = text.splitlines()
    dit = [line for line in lines if line.lstrip().startswith("dit:")]
    # 10%, 20%, ... 90%: step/total, [elapsed<ETA, rate, the latest losses]; then the end line.
    assert len(dit) == PROGRESS_LINES_PER_STAGE, dit
    for tenth, line in zip(range(1, 10), dit):
        step = tenth * 10
        assert re.fullmatch(
            rf"\s*dit: {step}/100 steps \[\d\d:\d\d<\d\d:\d\d, [\d.?]+\s?step/s, loss={1 / step:.4g}, aux=0\.5\]", line
        ), line
    assert re.fullmatch(r"\s*dit: 100/100 steps in \d\d:\d\d \([\d.?]+\s?step/s\), loss=0\.01, aux=0\.5", dit[-1]), dit[-1]


def test_a_stage_stopped_early_ends_with_its_last_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = io.StringIO()
    _train(tmp_path, monkeypatch, log)
    vae = [line.strip() for line in log.getvalue().splitlines() if line.lstrip().startswith("vae:")]
    assert [line.split(" steps")[0] for line in vae] == ["vae: 10/100", "vae: 20/100", "vae: 30/100", "vae: 37/100"], vae
    assert re.fullmatch(rf"vae: 37/100 steps in \d\d:\d\d \(.*\), recon={2 / 37:.4g}", vae[-1]), vae[-1]
    assert log.getvalue().splitlines()[-1].strip() == vae[-1]  # the run's last progress line


def test_on_a_terminal_a_live_bar_with_the_losses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    _train(tmp_path, monkeypatch, terminal)
    text = terminal.getvalue()
    assert "\r" in text  # redrawn in place
    assert re.search(r"dit: 100%\|.*\| 100/100 \[\d\d:\d\d<\d\d:\d\d, .*step/s, loss=0\.01, aux=0\.5\]", text), text
    assert re.search(rf"vae:  37%\|.*\| 37/100 \[.*, recon={2 / 37:.4g}\]", text), text  # left at the step it stopped


def test_quiet_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for stream in (io.StringIO(), _Terminal()):
        _train(tmp_path / str(stream.isatty()), monkeypatch, stream, progress=False)
        assert stream.getvalue() == ""


def test_negative_control_tqdm_itself_to_a_log_writes_carriage_returns() -> None:
    """What ``fv train`` did before (a tqdm bar whatever stderr is) fills a log with ``\\r`` redraws:
    the property the off-a-terminal test asserts absent is present in the old behaviour."""
    from tqdm import tqdm

    log = io.StringIO()
    bar = tqdm(total=TOTAL, desc="dit", unit="step", dynamic_ncols=True, file=log, mininterval=0)
    for step in range(1, FULL + 1):
        bar.set_postfix({"loss": f"{1.0 / step:.4g}"}, refresh=False)
        bar.update(1)
    bar.close()
    assert log.getvalue().count("\r") > 10
