"""Run one request directly, without the scheduler: every plan executes as soon as it is made.

The reference path for parity tests and the conformance kit, and the simplest way
to use a card from a script. The Engine is the path for anything concurrent.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from fv_kernel.cache.feature import FeatureCache, apply_cache_writes
from fv_kernel.model.instance import ModelInstance
from fv_kernel.model.validate import RequestLimits, resolve_for_instance
from fv_kernel.extend.registry import ExtensionSet
from fv_kernel.loop.contract import LoopContext
from fv_kernel.loop.contract import LoopState
from fv_kernel.loop.plan import StepResult, WorkPlan
from fv_kernel.program.resume import ProgramCheckpoint, ProgramRun, run_program
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.request import Request
from fv_kernel.runtime.blocking import run_blocking

__all__ = ["run_local", "run_local_async", "wait_for_host_outputs"]


def wait_for_host_outputs(device: torch.device, outputs: Mapping[str, torch.Tensor]) -> None:
    """Wait for ``device``'s queued work when a step handed back host tensors.

    An op may copy its results to the host non-blocking (fv-wan's decode puts each frame in
    pinned memory that way): such a tensor is not written until the device gets there, so it
    must not be read before. The Engine waits on each batch's end event; this is the same
    wait for :func:`run_local`, which nothing else makes.
    """
    if device.type == "cuda" and any(t.device.type == "cpu" for t in outputs.values()):
        torch.cuda.current_stream(device).synchronize()


async def run_local_async(
    request: Request,
    instance: ModelInstance,
    *,
    on_state: Callable[[LoopState], LoopState | None] | None = None,
    on_event: Callable[..., None] | None = None,
    limits: RequestLimits | None = None,
    services: dict[str, Any] | None = None,
    extensions: ExtensionSet | None = None,
    resume_from: ProgramCheckpoint | None = None,
    on_step: Callable[[ProgramRun], None] | None = None,
) -> list[Artifact]:
    """Run ``request`` on ``instance``; every plan executes at once, in this task.

    ``resume_from`` continues a :class:`ProgramCheckpoint` of the same request (taken in
    this process or another); ``on_step`` is called with the request's
    :class:`ProgramRun` after every step (``run.checkpoint()`` is the resume point then).
    """
    resolved = resolve_for_instance(instance, request, limits)
    instance.load_for_task(resolved.task)
    program = instance.program(resolved.task)
    run = ProgramRun(program, instance, resolved, resume_from=resume_from, on_step=on_step)

    services = services if services is not None else {"feature_cache": FeatureCache()}

    async def execute(plan: WorkPlan) -> StepResult:
        op = instance.op(plan.op)
        with torch.inference_mode():
            outputs = op.fn(plan.inputs, plan.params)
        wait_for_host_outputs(instance.device, outputs)
        apply_cache_writes(plan.cache, outputs, services)
        return StepResult(outputs=outputs)

    ctx = LoopContext(
        request=resolved, executor=execute, on_state=on_state,
        emit_event=on_event or (lambda *a, **k: None),
        services=services,
        hooks=None if extensions is None else extensions.hooks_for(
            instance.card, program.loop_ids(resolved), resolved.plugin_params, exact=resolved.exact
        ),
    )
    return resolved.output.keep(await run_program(program, instance, ctx, run=run))


def run_local(request: Request, instance: ModelInstance, **kwargs: Any) -> list[Artifact]:
    """Blocking form of :func:`run_local_async`."""
    return run_blocking(run_local_async(request, instance, **kwargs))
