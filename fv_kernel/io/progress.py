"""Progress on stderr, through tqdm: a ticking start-up line, then one line per stage.

On a terminal each stage is a live tqdm line (elapsed, ETA, rate, and the caller's figures such
as losses). When the stream is not a terminal (a log file, a pipe, CI, a remote job) nothing is
redrawn, so no carriage return is ever written: plain lines only -- one when loading starts and
ends, optionally one each time a stage completes another share of its steps (``plain_parts``),
and one per finished stage (stopped early, it shows the last step reported).

Used by ``fv generate`` and ``fv train`` (:mod:`fv_kernel.training.runner`), so it lives outside
``fv_kernel.cli``. Light on purpose (tqdm only, imported lazily): ``fv`` shows a start-up
spinner before it imports torch.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, TextIO

__all__ = ["StageProgress", "LoadingStage", "spinner"]


def _is_tty(stream: Any) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


@contextmanager
def spinner(description: str, stream: TextIO | None = None, *, keep: bool = False) -> Iterator[Any]:
    """On a terminal, ``description`` and a ticking elapsed time while the body runs; nothing otherwise.

    The line stays when ``keep`` is set and the body succeeds; otherwise it is erased. Yields
    the tqdm bar (None off a terminal), whose ``desc`` the body may change.
    """
    stream = stream if stream is not None else sys.stderr
    if not _is_tty(stream):
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=None, desc=description, bar_format="{desc} {elapsed}", file=stream, leave=keep)
    done = threading.Event()

    def tick() -> None:  # the elapsed time moves while the main thread imports or builds
        while not done.wait(0.2):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="fv-spinner", daemon=True)
    ticker.start()
    failed = False
    try:
        yield bar
    except BaseException:
        failed = True
        raise
    finally:
        done.set()
        ticker.join()
        if failed:
            bar.leave = False  # an error line follows: leave only that
        bar.close()


class LoadingStage:
    """What :meth:`StageProgress.loading` yields: call :meth:`validated` once the request passed every check."""

    def __init__(self, progress: "StageProgress", bar: Any) -> None:
        self._progress = progress
        self._bar = bar
        self.what: str | None = None
        self.started = time.monotonic()

    def validated(self, what: str) -> None:
        """The request is valid; building and loading ``what`` begins (a plain line off a terminal)."""
        self.what = what
        if self._bar is not None:
            self._bar.set_description_str(f"loading {what}")
        elif self._progress.enabled:
            self._progress.write(f"loading {what}...")


class StageProgress:
    """tqdm progress for one run: ``loading`` around start-up, :meth:`update` per loop step.

    ``plain_parts`` (e.g. 10): off a terminal, also a plain line each time a stage completes
    another 1/``plain_parts`` of its total (step/total, elapsed, ETA, rate, the latest
    figures), so a long stage shows it is alive; None: only the line when the stage ends.
    """

    BAR = "{desc:>12}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
    PLAIN = "{desc:>12}: {n_fmt}/{total_fmt} {unit}s in {elapsed} ({rate_fmt}){postfix}"
    PLAIN_PROGRESS = "{desc:>12}: {n_fmt}/{total_fmt} {unit}s [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
    UNBOUNDED = "{desc:>12}: {n_fmt} {unit}s [{elapsed}, {rate_fmt}{postfix}]"

    def __init__(self, enabled: bool, stream: TextIO | None = None, *, plain_parts: int | None = None) -> None:
        if plain_parts is not None and plain_parts < 2:
            raise ValueError(f"plain_parts must be at least 2 (or None), got {plain_parts!r}")
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _is_tty(self.stream)
        self.plain_parts = plain_parts
        self._bar: Any = None
        self._stage: str | None = None
        # Off a terminal a stage's clock starts at the previous event (construction, the end of
        # loading, the last step of the previous stage), so its first step counts in its time and rate.
        self._last_event = time.monotonic()
        self._started = 0.0
        self._step = 0
        self._total: int | None = None
        self._postfix = ""
        self._plain_part = 0  # off a terminal: how many parts of the stage the last plain line had done

    def write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    @contextmanager
    def loading(self, what: str) -> Iterator[LoadingStage]:
        """Start-up: on a terminal a "loading <what>" line with a ticking elapsed time from the start
        (erased if start-up fails, so an error stays one line); off a terminal a "loading" line once
        the request is valid and a "loaded ... in" line at the end."""
        if not self.enabled:
            yield LoadingStage(self, None)
            return
        from tqdm import tqdm

        with spinner(f"loading {what}", self.stream, keep=True) as bar:
            stage = LoadingStage(self, bar)
            yield stage
        if bar is None and stage.what is not None:
            self.write(f"loaded {stage.what} in {tqdm.format_interval(time.monotonic() - stage.started)}")
        self._last_event = time.monotonic()

    def update(self, stage: str, step: int, total: int | None, figures: Mapping[str, float] | None = None) -> None:
        """Step ``step`` of ``total`` (None: unknown) of ``stage``; a new stage ends the previous one.

        ``figures`` (e.g. the latest losses) are shown beside the step count: the bar's postfix on
        a terminal, the end of each plain line off one.
        """
        if not self.enabled:
            return
        if stage != self._stage:
            self._end_stage()
            self._stage, self._started, self._total = stage, self._last_event, total
            self._plain_part = 0
            if self.tty:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=stage, unit="step", file=self.stream, leave=True, dynamic_ncols=True,
                                 bar_format=self.BAR if total else self.UNBOUNDED)
        self._step, self._last_event = step, time.monotonic()
        self._postfix = ", ".join(f"{k}={v:.4g}" for k, v in figures.items()) if figures else ""
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self._total and self.plain_parts and step < self._total:  # the stage's end has its own line
            part = step * self.plain_parts // self._total
            if part > self._plain_part:
                self._plain_part = part
                self.write(self._meter(self.PLAIN_PROGRESS))

    def _meter(self, bar_format: str) -> str:
        from tqdm import tqdm

        return tqdm.format_meter(
            self._step, self._total, self._last_event - self._started, prefix=self._stage or "", unit="step",
            postfix=self._postfix or None, bar_format=bar_format if self._total else self.UNBOUNDED,
        )

    def _end_stage(self) -> None:
        if self._stage is None:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            self.write(self._meter(self.PLAIN))
        self._stage = None

    def close(self) -> None:
        """End the current stage (its line is complete; a stage stopped early shows its last step)."""
        if self.enabled:
            self._end_stage()
