"""Assembling a request's hooks, and running block hooks inside a family's step op.

The runtime builds one :class:`RequestHooks` per request from the deploy-enabled
extensions and the request's validated parameters. The driver uses it to wrap
``ctx.execute`` (step interceptors) and to attach a :class:`BlockHooks` to plans
whose op runs a block sequence (``StepOp.supports_block_hooks``). A request with
no active extension gets no hooks at all.

A family's op that supports block hooks runs each row alone when
``params["block_hooks"]`` is present and calls ``hooks.run(row, blocks, hidden)``
instead of its own block loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import torch
from pydantic import BaseModel

from fv_kernel.extend.interceptors import BlockCall, BlockInterceptor, BlockSequence, StepInterceptor
from fv_kernel.extend.observers import BlockObserver

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.loop.contract import LoopState
    from fv_kernel.loop.plan import StepResult, WorkPlan

__all__ = ["ActiveInterceptor", "BlockHooks", "RequestHooks", "branches_of"]


@dataclass(frozen=True)
class ActiveInterceptor:
    """An enabled interceptor with one request's validated parameters."""

    interceptor: Any
    params: BaseModel

    @property
    def plugin_id(self) -> str:
        return self.interceptor.plugin_id


def branches_of(plan: "WorkPlan") -> list[str]:
    """The guidance branch of each row of a step (from ``plan.tag``, e.g. "cond+uncond")."""
    return plan.tag.split("+") if plan.tag else ["main"]


class _ObservedBlocks:
    """A block sequence that reports every block's output to read-only observers."""

    def __init__(self, blocks: BlockSequence, observers: tuple[BlockObserver, ...], call: BlockCall) -> None:
        self._blocks, self._observers, self._call = blocks, observers, call

    @property
    def num_blocks(self) -> int:
        return self._blocks.num_blocks

    def run(self, start: int, stop: int, hidden: torch.Tensor) -> torch.Tensor:
        for index in range(start, stop):
            hidden = self._blocks.run(index, index + 1, hidden)
            for observer in self._observers:
                observer.on_block(self._call, index, hidden)
        return hidden


class BlockHooks:
    """One request's block hooks for one step; rides in ``WorkPlan.params["block_hooks"]``.

    Equality (and so batch compatibility) depends on the hooks, not on the request's
    state, so two requests with the same extension settings still batch together.
    """

    def __init__(
        self,
        calls: list[BlockCall],
        interceptor: ActiveInterceptor | None,
        states: list[dict[str, Any]],
        observers: tuple[BlockObserver, ...],
    ) -> None:
        self.calls, self.interceptor, self.states, self.observers = calls, interceptor, states, observers

    def _key(self) -> tuple[Any, ...]:
        inter = None if self.interceptor is None else (self.interceptor.plugin_id, self.interceptor.params)
        return (inter, tuple(id(o) for o in self.observers))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockHooks) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def run(self, row: int, blocks: BlockSequence, hidden: torch.Tensor) -> torch.Tensor:
        """Run row ``row``'s block sequence through the interceptor and observers."""
        call = self.calls[row]
        sequence: BlockSequence = _ObservedBlocks(blocks, self.observers, call) if self.observers else blocks
        if self.interceptor is None:
            return sequence.run(0, sequence.num_blocks, hidden)
        block_interceptor: BlockInterceptor = self.interceptor.interceptor
        return block_interceptor.run_blocks(sequence, hidden, self.states[row], self.interceptor.params, call)


@dataclass
class RequestHooks:
    """The extensions active for one request."""

    step: list[ActiveInterceptor] = field(default_factory=list)
    block: ActiveInterceptor | None = None
    block_observers: tuple[BlockObserver, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.step or self.block or self.block_observers)

    def attach(self, plan: "WorkPlan", state: "LoopState", *, supports_block_hooks: bool, num_steps: int | None) -> "WorkPlan":
        """Add this request's block hooks to ``plan`` when its op can run them."""
        applies = self.block is not None and self.block.interceptor.applies_to(plan)
        if not supports_block_hooks or not (applies or self.block_observers):
            return plan
        step_index = plan.step_index if plan.step_index is not None else state.step
        calls, states = [], []
        for branch in branches_of(plan):
            calls.append(BlockCall(state.request_id, state.loop_id, branch, step_index, num_steps))
            if applies:
                assert self.block is not None
                states.append(state.plugin_state.setdefault(self.block.plugin_id, {}).setdefault(branch, {}))
            else:
                states.append({})
        hooks = BlockHooks(calls, self.block if applies else None, states, self.block_observers)
        return plan.model_copy(update={"params": {**plan.params, "block_hooks": hooks}})

    async def execute(
        self, plan: "WorkPlan", state: "LoopState", call: Callable[["WorkPlan"], Awaitable["StepResult"]]
    ) -> "StepResult":
        """Run ``plan`` through the step interceptors (outermost first), then ``call``."""
        chain = call
        for active in reversed([a for a in self.step if a.interceptor.applies_to(plan)]):
            chain = _wrap(active, state, chain)
        return await chain(plan)


def _wrap(
    active: ActiveInterceptor, state: "LoopState", inner: Callable[["WorkPlan"], Awaitable["StepResult"]]
) -> Callable[["WorkPlan"], Awaitable["StepResult"]]:
    step_interceptor: StepInterceptor = active.interceptor

    async def call(plan: "WorkPlan") -> "StepResult":
        plugin_state = state.plugin_state.setdefault(active.plugin_id, {})
        return await step_interceptor.around_step(plan, plugin_state, active.params, inner)

    return call
