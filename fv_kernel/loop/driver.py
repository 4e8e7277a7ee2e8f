"""The driver: the only place iteration lives (design §5.1).

    state = loop.init(req, model, ctx)
    while (plan := loop.next(state)) is not Done:
        result = await ctx.execute(plan)        # the single seam
        state = loop.advance(state, result)
        emit plan.emits (media.init before a stream's first chunk); check cancellation
    emit Done.emits; result = loop.finalize(state); media.complete for each stream the loop opened
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from fv_kernel.errors import InvalidRequest, RequestCancelled
from fv_kernel.loop.contract import Done, Loop, LoopContext, LoopResult, LoopState, ResidentModel
from fv_kernel.loop.plan import EmitSpec, StepResult
from fv_kernel.loop.samplers import use_samplers

__all__ = ["drive", "resume", "LoopCancelled"]


class LoopCancelled(RequestCancelled):
    """Cancellation observed at a step boundary, carrying the loop's partial result (if meaningful)."""

    def __init__(self, reason: str, partial: LoopResult | None, state: LoopState) -> None:
        super().__init__(reason)
        self.partial = partial
        self.state = state


def _emit_chunks(ctx: LoopContext, emits: Sequence[EmitSpec], result: StepResult | None,
                 counters: dict[str, int]) -> None:
    """Emit a plan's (or a ``Done``'s) chunks, reading named outputs from ``result``; ``counters``
    (stream -> next index) holds the streams this loop opened."""
    previews = ctx.request.output.stream_previews
    for emit in emits:
        if emit.preview and not previews:
            continue  # a preview is a copy and an event: only requests that ask for previews pay for them
        payload: dict[str, Any] = {}
        if emit.text is not None:
            payload["text"] = emit.text
        elif emit.from_output is not None and result is not None:
            tensor = result.outputs[emit.from_output]
            payload["samples" if emit.modality == "audio" else "frames"] = tensor.detach()
        else:
            continue
        if emit.stream not in counters:
            fps = emit.fps
            if fps is None and emit.modality == "video":
                fps = ctx.request.diffusion.fps
            ctx.emit("media.init", stream=emit.stream, modality=emit.modality, fps=fps, sample_rate=emit.sample_rate)
            counters[emit.stream] = 0
        index = counters[emit.stream]
        counters[emit.stream] = index + 1
        ctx.emit("media.chunk", stream=emit.stream, index=index, pts=emit.pts, preview=emit.preview, **payload)


async def resume(loop: Loop[Any], state: LoopState, ctx: LoopContext) -> LoopResult:
    """Drive ``loop`` from a state that is ready to run (from ``init`` or ``restore``) to the end.

    A state read back from bytes goes through :func:`drive` with ``state=`` instead, so
    the loop's ``restore`` hook re-attaches its per-process resources first.
    """
    counters: dict[str, int] = {}
    capture = ctx.request.output.capture_behavior != "off"
    if capture and loop.kind == "diffusion_denoise" and not loop.captures_behavior:
        raise InvalidRequest(
            "output.capture_behavior", f"loop {loop.loop_id!r} ({type(loop).__name__}) does not capture behaviour",
            allowed=["off"],
        )
    while True:
        if ctx.cancel.cancelled:
            raise LoopCancelled(ctx.cancel.reason or "cancelled", loop.partial(state), state)
        plan = loop.next(state)
        if isinstance(plan, Done):
            _emit_chunks(ctx, plan.emits, None, counters)  # what the last step made that no plan carries
            break
        if plan.step_index is None:
            plan = plan.model_copy(update={"step_index": state.step})
        try:
            if ctx.hooks is not None:
                supports = ctx.instance is not None and ctx.instance.op(plan.op).supports_block_hooks
                plan = ctx.hooks.attach(plan, state, supports_block_hooks=supports, num_steps=loop.progress(state)[1])
                result = await ctx.hooks.execute(plan, state, ctx.execute)
            else:
                result = await ctx.execute(plan)
        except LoopCancelled:
            raise
        except RequestCancelled as exc:  # cancelled while the step was queued: report what we have
            raise LoopCancelled(exc.message, loop.partial(state), state) from None
        state = loop.advance(state, result)
        if capture:
            captured = loop.behavior_slice(state)
            if captured is not None:
                ctx.emit("behavior.slice", loop_id=loop.loop_id, slice=captured)
        _emit_chunks(ctx, plan.emits, result, counters)
        done, total = loop.progress(state)
        ctx.emit("progress", loop_id=loop.loop_id, step=done, total=total)
        if ctx.on_state is not None:
            # A checkpoint hook may hand back a replacement (e.g. the state restored from bytes).
            replacement = ctx.on_state(state)
            if replacement is not None:
                state = replacement
    result = loop.finalize(state)
    # The loop that opened a stream closes it once it has finished; a failed or cancelled
    # loop leaves its streams open, and the request's terminal event ends them.
    for stream in counters:
        ctx.emit("media.complete", stream=stream)
    return result


async def drive(
    loop: Loop[Any], model: ResidentModel, ctx: LoopContext, *, state: LoopState | None = None
) -> LoopResult:
    """Run one loop for ``ctx.request`` on ``model``.

    With ``state`` (a saved state read back from bytes, maybe in another process) the
    loop continues from it: the driver calls ``loop.restore(state, model, ctx)``
    instead of ``loop.init`` so the loop re-attaches what lives outside its state.

    Sampler names the loop resolves (its binding, a state's signature) resolve through
    the deploy registry ``model`` was built with (``use_samplers``), plugins' included.
    """
    with use_samplers(model.registry.samplers):
        return await _drive(loop, model, ctx, state=state)


async def _drive(loop: Loop[Any], model: ResidentModel, ctx: LoopContext, *, state: LoopState | None) -> LoopResult:
    ctx = dataclasses.replace(ctx, instance=model)
    if state is None:
        state = loop.init(ctx.request, model, ctx)
    else:
        if state.loop_id != loop.loop_id or state.request_id != ctx.request.request_id:
            raise ValueError(
                f"a state of loop {state.loop_id!r} / request {state.request_id!r} cannot resume loop "
                f"{loop.loop_id!r} of request {ctx.request.request_id!r}"
            )
        # The instance that saved the state may be gone (another process): plans name this one.
        state = loop.restore(state.model_copy(update={"instance_id": model.instance_id}), model, ctx)
    return await resume(loop, state, ctx)
