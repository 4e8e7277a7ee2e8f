"""Progress on stderr for the CLI, through tqdm: a ticking start-up line, then one line per stage.

On a terminal each stage is a live tqdm line (elapsed, ETA, rate). When the stream is not a
terminal (a log file, a pipe, CI) nothing is redrawn, so no carriage return is ever written:
one plain line when loading starts and ends, and one line per finished stage.

Light on purpose (tqdm only): ``fv`` shows a start-up spinner before it imports torch.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, TextIO

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
    """tqdm progress for one request: ``loading`` around start-up, :meth:`update` per loop step."""

    BAR = "{desc:>12}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"
    PLAIN = "{desc:>12}: {n_fmt}/{total_fmt} {unit}s in {elapsed} ({rate_fmt})"
    UNBOUNDED = "{desc:>12}: {n_fmt} {unit}s [{elapsed}, {rate_fmt}]"

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _is_tty(self.stream)
        self._bar: Any = None
        self._stage: str | None = None
        self._started = 0.0
        self._step = 0
        self._total: int | None = None

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

    def update(self, stage: str, step: int, total: int | None) -> None:
        """Step ``step`` of ``total`` (None: unknown) of ``stage``; a new stage ends the previous one."""
        if not self.enabled:
            return
        if stage != self._stage:
            self._end_stage()
            self._stage, self._started, self._total = stage, time.monotonic(), total
            if self.tty:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=stage, unit="step", file=self.stream, leave=True,
                                 bar_format=self.BAR if total else self.UNBOUNDED)
        self._step = step
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def _end_stage(self) -> None:
        if self._stage is None:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            from tqdm import tqdm

            self.write(tqdm.format_meter(
                self._step, self._total, time.monotonic() - self._started, prefix=self._stage, unit="step",
                bar_format=self.PLAIN if self._total else self.UNBOUNDED,
            ))
        self._stage = None

    def close(self) -> None:
        """End the current stage (its line is complete)."""
        if self.enabled:
            self._end_stage()
