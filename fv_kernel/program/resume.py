"""Program checkpoints: stop a request between two steps, continue it later, maybe in another process.

A request runs several loops (a program), so a resume point is more than one
``LoopState``: it is a :class:`ProgramCheckpoint` holding the request, the loops that
finished (their outputs, which the next loops read as ``ctx.upstream``, and their
artifacts) and the latest state of every loop still in flight.

The runtime runs each request through a :class:`ProgramRun`. A program that calls
:meth:`~fv_kernel.program.base.Program.run_loop` for every loop gets, for free:

- recording: after each step the run knows every loop's latest state, so
  :meth:`ProgramRun.checkpoint` can be taken at any step boundary;
- replay: resumed from a checkpoint, the program's own code runs again from the top;
  a loop that had finished returns its recorded result at once, the loop that was in
  flight continues from its saved state (``Loop.restore``, then the remaining steps),
  later loops run as usual. Control flow must therefore depend only on the request
  and on loop results, which is what ``Program.resumable = True`` declares.

Checkpoints serialize like every state (``to_bytes`` / ``from_bytes``, loaded with
``weights_only=True``); a state that holds something unserializable fails when the
checkpoint is written, naming the loop and the field.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch
from pydantic import Field

from fv_kernel.errors import FvError, InvalidRequest
from fv_kernel.loop.contract import LoopContext, LoopResult, LoopState, ResidentModel
from fv_kernel.loop.driver import drive
from fv_kernel.program.base import PROGRAM_RUN, Program
from fv_kernel.state import StateFormatError, StateNotSerializable, TensorState, _qualified, _to_plain
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.request import Request

__all__ = [
    "CheckpointIncompatible",
    "ProgramNotResumable",
    "FinishedLoop",
    "RunningLoop",
    "ProgramCheckpoint",
    "ProgramRun",
    "run_program",
]


class CheckpointIncompatible(FvError):
    """A checkpoint cannot continue on this instance: another request, card, weights, program or state layout."""

    error_type = "checkpoint_incompatible"


class ProgramNotResumable(FvError):
    """The card's program for this task does not declare ``resumable``: a started request cannot continue."""

    error_type = "not_resumable"


class FinishedLoop(TensorState):
    """A loop that ran to the end: what it handed on (``outputs``) and what it produced (``artifacts``)."""

    #: The loop id, with ``#n`` appended for the n-th run (n >= 2) of one loop in a request.
    key: str
    loop_id: str
    outputs: dict[str, Any] = Field(default_factory=dict)
    artifacts: list[Artifact] = Field(default_factory=list)


class RunningLoop(TensorState):
    """A loop in flight: its latest state as a checked payload (read back with the card's ``state_type``)."""

    key: str
    loop_id: str
    step: int
    state: dict[str, Any]


class ProgramCheckpoint(TensorState):
    """One request's resume point: the request, the finished loops and the states of the loops in flight.

    The state types of running loops come from the card's loops when the checkpoint is
    opened (:class:`ProgramRun` with ``resume_from=``), never from the bytes.
    """

    request: Request
    model_id: str
    weights_version: str
    #: The program class that wrote it (``module:Class``); another program cannot continue it.
    program: str
    finished: list[FinishedLoop] = Field(default_factory=list)
    running: list[RunningLoop] = Field(default_factory=list)

    @property
    def started(self) -> bool:
        """Whether any step ran (a checkpoint of a request that has not started only records the request)."""
        return bool(self.finished or self.running)

    @property
    def upstream(self) -> dict[str, Any]:
        """The outputs of the finished loops, merged in the order they finished."""
        merged: dict[str, Any] = {}
        for done in self.finished:
            merged.update(done.outputs)
        return merged

    @property
    def artifacts(self) -> list[Artifact]:
        """The artifacts the finished loops produced, in order."""
        return [artifact for done in self.finished for artifact in done.artifacts]

    def position(self) -> str:
        """Where the request stands, for logs and errors (e.g. ``denoise at step 3``)."""
        if self.running:
            return ", ".join(f"{r.key} at step {r.step}" for r in self.running)
        if self.finished:
            return f"after {self.finished[-1].key}"
        return "not started"

    @classmethod
    def for_request(cls, program: Program, model: ResidentModel, request: Request) -> "ProgramCheckpoint":
        """The checkpoint of ``request`` before its first step (it records what to run)."""
        return ProgramRun(program, model, request).checkpoint()

    def _payload(self) -> dict[str, Any]:
        try:
            return super()._payload()
        except StateNotSerializable as exc:
            # Name the loop whose outputs hold the value, not just the checkpoint's field path.
            found = re.match(r"(finished|running)\[(\d+)\]", exc.param or "")
            if found is None:
                raise
            loop_id = getattr(self, found.group(1))[int(found.group(2))].loop_id
            raise StateNotSerializable(f"{exc.message} (from loop {loop_id!r})", param=exc.param) from None


def _same(a: Any, b: Any) -> bool:
    """Deep equality of plain request data, comparing tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


#: Called after every step of every loop of the request with its run (e.g. to write a checkpoint every N steps).
StepCallback = Callable[["ProgramRun"], None]


class ProgramRun:
    """One request's way through its program: it records each loop's progress and replays a checkpoint.

    The runtime builds one per request (with ``resume_from`` to continue a checkpoint)
    and hands it to the program through ``ctx.services[PROGRAM_RUN]``;
    :meth:`Program.run_loop <fv_kernel.program.base.Program.run_loop>` finds it there.
    Opening a checkpoint checks it against the instance and decodes every saved state
    up front, so an unusable checkpoint fails before the request is queued.
    """

    def __init__(
        self,
        program: Program,
        model: ResidentModel,
        request: Request,
        *,
        resume_from: ProgramCheckpoint | None = None,
        on_step: StepCallback | None = None,
    ) -> None:
        self.program_name = _qualified(type(program))
        self.resumable = bool(program.resumable)
        self.model = model
        self.request = request
        self.on_step = on_step
        #: Step boundaries passed by this run (in this process).
        self.steps = 0
        self._finished: dict[str, FinishedLoop] = {}
        self._running: dict[str, tuple[str, LoopState]] = {}
        self._occurrences: dict[str, int] = {}
        self._replay: dict[str, FinishedLoop] = {}
        self._restore: dict[str, tuple[str, LoopState]] = {}
        if resume_from is not None:
            self._open(resume_from)

    # -- opening a checkpoint -----------------------------------------------------------
    def _open(self, checkpoint: ProgramCheckpoint) -> None:
        request_id = self.request.request_id

        def incompatible(field: str, why: str) -> CheckpointIncompatible:
            return CheckpointIncompatible(f"checkpoint of request {checkpoint.request.request_id!r}: {why}", param=field)

        if checkpoint.request.request_id != request_id:
            raise incompatible("request_id", f"it cannot resume request {request_id!r}")
        if checkpoint.model_id != self.model.model_id:
            raise incompatible("model", f"saved on card {checkpoint.model_id!r}, this instance is {self.model.model_id!r}")
        if checkpoint.weights_version != self.model.weights_version:
            raise incompatible(
                "weights_version",
                f"saved with weights {checkpoint.weights_version!r}, this instance has {self.model.weights_version!r}",
            )
        if checkpoint.program != self.program_name:
            raise incompatible("program", f"written by program {checkpoint.program}, this task runs {self.program_name}")
        if not _same(_to_plain(checkpoint.request), _to_plain(self.request)):
            raise incompatible("request", "the request differs from the one the checkpoint was taken for")
        if checkpoint.started and not self.resumable:
            raise ProgramNotResumable(
                f"program {self.program_name} of card {self.model.model_id!r} does not support resuming a started "
                f"request ({checkpoint.position()}); it declares resumable = False",
                param="program",
            )
        for done in checkpoint.finished:
            self._replay[done.key] = done
        for running in checkpoint.running:
            try:
                loop = self.model.loop(running.loop_id)
            except InvalidRequest:
                raise incompatible("running", f"card {self.model.model_id!r} has no loop {running.loop_id!r}") from None
            try:
                state = loop.state_type.from_payload(running.state)
            except StateFormatError as exc:
                raise incompatible("running", f"the state of loop {running.key!r} cannot be read: {exc.message}") from None
            self._restore[running.key] = (running.loop_id, state)

    # -- recording ------------------------------------------------------------------------
    def _key(self, loop_id: str) -> str:
        count = self._occurrences.get(loop_id, 0) + 1
        self._occurrences[loop_id] = count
        return loop_id if count == 1 else f"{loop_id}#{count}"

    async def loop(self, loop_id: str, model: ResidentModel, ctx: LoopContext) -> LoopResult:
        """Run (or replay, or continue) the program's next use of ``loop_id``."""
        key = self._key(loop_id)
        replayed = self._replay.pop(key, None)
        if replayed is not None:
            self._finished[key] = replayed
            return LoopResult(loop_id=loop_id, outputs=dict(replayed.outputs), artifacts=list(replayed.artifacts))
        saved = self._restore.pop(key, None)
        state = saved[1] if saved is not None else None
        if state is not None:
            self._running[key] = (loop_id, state)
        forward = ctx.on_state

        def on_state(new_state: LoopState) -> LoopState | None:
            self._running[key] = (loop_id, new_state)
            self.steps += 1
            if self.on_step is not None:
                self.on_step(self)
            replacement = forward(new_state) if forward is not None else None
            if replacement is not None:
                self._running[key] = (loop_id, replacement)
            return replacement

        result = await drive(model.loop(loop_id), model, dataclasses.replace(ctx, on_state=on_state), state=state)
        self._running.pop(key, None)
        self._finished[key] = FinishedLoop(key=key, loop_id=loop_id, outputs=result.outputs, artifacts=result.artifacts)
        return result

    def checkpoint(self) -> ProgramCheckpoint:
        """The request's resume point now (between two steps). Raises :class:`StateNotSerializable` early."""
        running = [
            RunningLoop(key=key, loop_id=loop_id, step=state.step, state=state.to_payload())
            for key, (loop_id, state) in [*self._running.items(), *self._restore.items()]
        ]
        return ProgramCheckpoint(
            request=self.request, model_id=self.model.model_id, weights_version=self.model.weights_version,
            program=self.program_name, finished=[*self._finished.values(), *self._replay.values()], running=running,
        )


async def run_program(
    program: Program, model: ResidentModel, ctx: LoopContext, *, run: ProgramRun | None = None
) -> list[Artifact]:
    """Run ``program`` for ``ctx.request`` through ``run`` (a fresh, recording one when None).

    The runtime's entry point into a program; it makes ``run`` reachable from the
    program's loops (``ctx.services[PROGRAM_RUN]``) without sharing it with other requests.
    """
    if run is None:
        run = ProgramRun(program, model, ctx.request)
    elif run.program_name != _qualified(type(program)):
        raise ValueError(f"a run of {run.program_name} cannot drive program {_qualified(type(program))}")
    ctx = dataclasses.replace(ctx, services={**ctx.services, PROGRAM_RUN: run})
    return await program.run(model, ctx)
