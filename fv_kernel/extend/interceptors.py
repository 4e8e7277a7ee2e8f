"""Interceptors: plugins that may alter compute (design §11).

Two hook points, assembled per request when a loop is driven, so an unused hook
is absent from the hot path:

- :class:`StepInterceptor` wraps ``ctx.execute(plan)``: it may answer a step from its
  own cache (step skipping, cached predictions) instead of running it.
- :class:`BlockInterceptor` wraps a transformer's block sequence inside one step: it
  may skip a range of blocks and reuse a cached residual (DBCache, FBCache, TaylorSeer).

An interceptor's per-request state lives in ``LoopState.plugin_state[plugin_id][branch]``
(never on the interceptor or the model), so interleaved requests cannot see each
other's caches, and the state is saved and restored with the loop. Interceptors are
enabled at deploy scope only; a request can only parameterise an enabled one
through its validated ``request_model``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.loop.plan import StepResult, WorkPlan

__all__ = [
    "Interceptor",
    "InterceptorClass",
    "NoParams",
    "StepInterceptor",
    "BlockInterceptor",
    "BlockSequence",
    "BlockCall",
]

#: What an interceptor does to a loop; cards may refuse a class (few-step loops refuse step skipping).
InterceptorClass = Literal["step_skip", "block_cache"]


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Interceptor(abc.ABC):
    """Base of the plugin contribution kind ``interceptors``."""

    #: The id under which its state is kept in ``LoopState.plugin_state``; also its name in the deploy config.
    plugin_id: ClassVar[str]
    interceptor_class: ClassVar[InterceptorClass]
    #: Deploy-time configuration schema (the ``extensions.<plugin_id>.config`` of the deploy config).
    config_model: ClassVar[type[BaseModel]] = NoParams
    #: Per-request parameter schema (``Request.plugin_params[plugin_id]``).
    request_model: ClassVar[type[BaseModel]] = NoParams
    #: Plugin ids this interceptor cannot be enabled together with.
    conflicts_with: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: BaseModel | None = None) -> None:
        self.config = config if config is not None else self.config_model()

    @abc.abstractmethod
    def distribution_altering(self, params: BaseModel) -> bool:
        """Whether these request parameters can change the output distribution (exact mode refuses them)."""

    def parse_params(self, raw: dict[str, Any] | None) -> BaseModel:
        """Validate a request's parameters for this interceptor (unknown fields rejected)."""
        return self.request_model.model_validate(raw or {})

    def applies_to(self, plan: "WorkPlan") -> bool:
        """Whether this interceptor hooks ``plan`` (by default: denoise steps)."""
        return plan.kind.value == "diffusion_step"


class StepInterceptor(Interceptor):
    """Wraps one step: ``around_step`` may return a result without calling ``call_next``."""

    interceptor_class: ClassVar[InterceptorClass] = "step_skip"

    @abc.abstractmethod
    async def around_step(
        self,
        plan: "WorkPlan",
        state: dict[str, Any],
        params: BaseModel,
        call_next: Callable[["WorkPlan"], Awaitable["StepResult"]],
    ) -> "StepResult":
        """Run (or answer) the step. ``state`` is this request's ``plugin_state[plugin_id]``."""


class BlockSequence(Protocol):
    """A transformer's block stack as a family exposes it to block hooks (one row, one step)."""

    @property
    def num_blocks(self) -> int: ...

    def run(self, start: int, stop: int, hidden: torch.Tensor) -> torch.Tensor:
        """Run blocks ``[start, stop)`` on the hidden states and return them."""
        ...


@dataclass(frozen=True)
class BlockCall:
    """Where a block sequence runs: which request, branch, loop and step."""

    request_id: str
    loop_id: str
    branch: str
    step_index: int
    num_steps: int | None


class BlockInterceptor(Interceptor):
    """Wraps a step's block sequence; may skip blocks and reuse cached residuals."""

    interceptor_class: ClassVar[InterceptorClass] = "block_cache"

    @abc.abstractmethod
    def run_blocks(
        self, blocks: BlockSequence, hidden: torch.Tensor, state: dict[str, Any], params: BaseModel, call: BlockCall
    ) -> torch.Tensor:
        """Produce the block stack's output; ``state`` is ``plugin_state[plugin_id][call.branch]``."""
