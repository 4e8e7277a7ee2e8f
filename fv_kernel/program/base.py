"""Programs compose a card's loops into a task (design §13).

The card says which loops exist; a program says how to run them for one request.
:class:`InlineProgram` runs a sequence of loops on one resident instance, handing
each loop's outputs to the next. A family with braided control flow (an omni
request that decodes text, then generates, then fans out decoders) writes its own
:class:`Program` with ``async`` code that runs each loop with :meth:`Program.run_loop`.

A program that runs every loop through :meth:`Program.run_loop`, and whose control
flow depends only on the request and the loops' results, declares ``resumable = True``:
the runtime can then checkpoint it at any step boundary and continue it from a
:class:`~fv_kernel.program.resume.ProgramCheckpoint`, maybe in another process.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Protocol

from fv_kernel.card.recipe import select_denoise_loop
from fv_kernel.card.refs import import_object
from fv_kernel.card.spec import ModelCard
from fv_kernel.errors import InvalidRequest
from fv_kernel.loop.contract import LoopContext, LoopResult, ResidentModel
from fv_kernel.loop.driver import drive
from fv_kernel.loop.plan import ResourceRequest
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.request import Request
from fv_kernel.request.types import TaskType

__all__ = ["PROGRAM_RUN", "LoopRunner", "Program", "InlineProgram", "program_for", "ProgramCompiler"]

#: The key of the request's :class:`LoopRunner` in ``LoopContext.services``: the runtime puts a
#: :class:`~fv_kernel.program.resume.ProgramRun` there when it records or resumes the request.
PROGRAM_RUN = "program_run"


class LoopRunner(Protocol):
    """Runs one loop of a request's program on the runtime's behalf (``ProgramRun``)."""

    async def loop(self, loop_id: str, model: ResidentModel, ctx: LoopContext) -> LoopResult:
        """Run (or, resuming, continue or replay) the program's loop ``loop_id``."""
        ...


class Program(abc.ABC):
    """Runs one request's loops; the runtime owns everything around it."""

    #: The program can continue from a checkpoint: it runs every loop through :meth:`run_loop`
    #: and its control flow depends only on the request and the loops' results. When False
    #: the runtime does not checkpoint it, and a started request cannot resume (it fails
    #: with ``not_resumable``); one that never started still runs from the beginning.
    resumable: ClassVar[bool] = False

    def __init__(self, card: ModelCard) -> None:
        self.card = card

    async def run_loop(self, loop_id: str, model: ResidentModel, ctx: LoopContext) -> LoopResult:
        """Run the card's loop ``loop_id`` for ``ctx.request`` (what ``run`` calls for each loop).

        Through the request's :class:`~fv_kernel.program.resume.ProgramRun` the runtime
        records the loop's progress for checkpoints and, resuming, returns the recorded
        result of a loop that had finished or continues the one that was in flight.
        """
        run: LoopRunner | None = ctx.services.get(PROGRAM_RUN)
        if run is not None:
            return await run.loop(loop_id, model, ctx)
        return await drive(model.loop(loop_id), model, ctx)

    @abc.abstractmethod
    async def run(self, model: ResidentModel, ctx: LoopContext) -> list[Artifact]:
        """Drive the loops for ``ctx.request`` and return its artifacts."""

    @abc.abstractmethod
    def loop_ids(self, request: Request) -> list[str]:
        """The loops this program runs for ``request`` (used to price it before admission)."""

    def estimate(self, model: ResidentModel, request: Request) -> ResourceRequest:
        """The request's whole-life needs: every loop's steps, summed resident and blocks, the largest peak.

        Loops run one step at a time on the device, so peaks do not add up; what a loop
        keeps (its outputs, its state) is counted for the whole request. The runtime
        prices ``steps`` with its cost model.
        """
        parts = [model.loop(loop_id).estimate(request, model) for loop_id in self.loop_ids(request)]
        explicit = [p.gpu_seconds for p in parts if p.gpu_seconds is not None]
        pool_blocks: dict[str, int] = {}
        for part in parts:
            for pool, blocks in part.pool_blocks.items():
                pool_blocks[pool] = pool_blocks.get(pool, 0) + blocks
        return ResourceRequest(
            gpu_seconds=sum(explicit) if explicit else None,
            resident_bytes=sum(p.resident_bytes for p in parts),
            peak_bytes=max((p.peak_bytes for p in parts), default=0),
            cache_blocks=sum(p.cache_blocks for p in parts),
            pool_blocks=pool_blocks,
            steps=tuple(step for p in parts for step in p.steps),
        )


class InlineProgram(Program):
    """A linear sequence of the card's loops on one instance; the degenerate, common case."""

    resumable = True

    def __init__(self, card: ModelCard, loops: tuple[str, ...]) -> None:
        super().__init__(card)
        self.loops = loops

    def loop_ids(self, request: Request) -> list[str]:
        return [
            (select_denoise_loop(self.card, request) or loop_id)
            if self.card.loops[loop_id].kind == "diffusion_denoise" else loop_id
            for loop_id in self.loops
        ]

    async def run(self, model: ResidentModel, ctx: LoopContext) -> list[Artifact]:
        upstream: dict[str, Any] = {}
        artifacts: list[Artifact] = []
        for loop_id in self.loop_ids(ctx.request):
            result = await self.run_loop(loop_id, model, ctx.child(upstream))
            upstream = {**upstream, **result.outputs}
            artifacts.extend(result.artifacts)
        return artifacts


def program_for(card: ModelCard, task: TaskType) -> Program:
    spec = card.programs.get(task)
    if spec is None:
        raise InvalidRequest("task", f"card {card.model_id!r} has no program for {task.value!r}", allowed=sorted(t.value for t in card.programs))
    if spec.loops:
        return InlineProgram(card, spec.loops)
    program_cls = import_object(spec.implementation or "")
    return program_cls(card)


class ProgramCompiler(abc.ABC):
    """Compiles an external workflow format (e.g. a node graph) into requests and programs.

    The base class of the plugin contribution kind ``program_compilers``.
    """

    #: The format this compiler accepts, e.g. "comfyui-api".
    format: str

    @abc.abstractmethod
    def compile(self, document: dict[str, Any]) -> list[Any]:
        """Turn a workflow document into fv requests; unknown nodes are a typed coverage error."""
