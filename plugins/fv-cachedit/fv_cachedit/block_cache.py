"""DBCache, FBCache and TaylorSeer as fv block interceptors.

One step of one CFG branch (one ``run_blocks`` call):

1. Run the first ``Fn`` blocks; their residual is ``R = H_Fn - H_in``.
2. Decide (cache-dit 1.5.3's rule, see :func:`can_reuse`): outside warmup, under the caps,
   with a previous residual ``P`` from the last *computed* step of this branch,
   reuse when ``mean|P - R| / mean|P| < residual_diff_threshold``.
3. Reuse: add the cached residual of the middle blocks (TaylorSeer: its Taylor
   extrapolation to this step). Compute: run the middle blocks, remember ``R`` and their
   residual.
4. Run the last ``Bn`` blocks.

All state is in the ``state`` dict the kernel hands in, which is
``LoopState.plugin_state[plugin_id][branch]``: per request, per loop, per CFG branch,
saved and restored with the loop. Nothing is kept on the interceptor or the model, so
interleaved requests cannot see each other's residuals. The step index comes from the
loop (``BlockCall.step_index``), not from counting transformer calls.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from fv_kernel.api import BlockCall, BlockInterceptor, BlockSequence, InvalidRequest

from fv_cachedit.overrides import apply_overrides, overrides_model

__all__ = [
    "DBCacheSettings",
    "FBCacheSettings",
    "TaylorSeerSettings",
    "DBCacheParams",
    "FBCacheParams",
    "TaylorSeerParams",
    "DBCache",
    "FBCache",
    "TaylorSeer",
    "relative_l1",
    "can_reuse",
    "warmup_steps",
]


class DBCacheSettings(BaseModel):
    """DBCache's knobs; names and defaults follow cache-dit's ``DBCacheConfig``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Blocks always computed first; their residual drives the decision.
    fn_compute_blocks: int = Field(default=8, ge=1)
    #: Blocks always computed last (they refine the approximated hidden states).
    bn_compute_blocks: int = Field(default=0, ge=0)
    #: Reuse when the relative L1 change of the Fn residual is below this; 0 never reuses (exact).
    residual_diff_threshold: float = Field(default=0.08, ge=0.0)
    #: Steps ``range(0, max_warmup_steps, warmup_interval)`` always compute.
    max_warmup_steps: int = Field(default=8, ge=0)
    warmup_interval: int = Field(default=1, ge=1)
    #: At most this many reused steps per branch (-1: no cap).
    max_cached_steps: int = Field(default=-1, ge=-1)
    #: At most this many reused steps in a row per branch (-1: no cap).
    max_continuous_cached_steps: int = Field(default=-1, ge=-1)
    #: Stop reusing once the summed diffs of this branch reach this (None: off).
    max_accumulated_residual_diff_threshold: Optional[float] = Field(default=None, gt=0.0)


class FBCacheSettings(DBCacheSettings):
    """First-block cache: DBCache with exactly one leading block."""

    fn_compute_blocks: Literal[1] = 1  # type: ignore[assignment]


class TaylorSeerSettings(DBCacheSettings):
    """DBCache whose reused middle residual is extrapolated from its history."""

    taylorseer_order: Literal[1, 2] = 1


DBCacheParams = overrides_model(DBCacheSettings, "DBCacheParams")
FBCacheParams = overrides_model(FBCacheSettings, "FBCacheParams")
TaylorSeerParams = overrides_model(TaylorSeerSettings, "TaylorSeerParams")


def warmup_steps(settings: DBCacheSettings) -> range:
    return range(0, settings.max_warmup_steps, settings.warmup_interval)


def relative_l1(previous: torch.Tensor, current: torch.Tensor) -> float:
    """``mean|previous - current| / mean|previous|`` (cache-dit's ``similarity`` without token selection)."""
    return ((previous - current).abs().mean() / previous.abs().mean()).item()


def can_reuse(state: dict[str, Any], settings: DBCacheSettings, step: int, fn_residual: torch.Tensor) -> bool:
    """cache-dit 1.5.3's ``CachedContextManager.can_cache`` on one branch's state; records the diff.

    Checks in cache-dit's order: warmup, max cached steps, max continuous cached steps,
    accumulated diff, threshold, a previous residual to compare with, equal shapes.
    """
    if step in warmup_steps(settings):
        return False
    cached: list[int] = state["cached_steps"]
    if settings.max_cached_steps >= 0 and len(cached) >= settings.max_cached_steps:
        return False
    if settings.max_continuous_cached_steps >= 0 and state["continuous_cached"] >= settings.max_continuous_cached_steps:
        return False
    limit = settings.max_accumulated_residual_diff_threshold
    if limit is not None and state["accumulated_diff"] >= limit:
        return False
    threshold = settings.residual_diff_threshold
    if threshold <= 0.0:
        return False
    previous: torch.Tensor | None = state.get("fn_residual")
    if previous is None:
        return False
    if threshold >= 1.0:  # cache-dit: a threshold of 1 or more means "always similar"
        _record_diff(state, step, -1.0)
        return True
    if previous.shape != fn_residual.shape:
        _record_diff(state, step, -2.0)
        return False
    diff = relative_l1(previous, fn_residual)
    _record_diff(state, step, diff)
    return diff < threshold


def _record_diff(state: dict[str, Any], step: int, diff: float) -> None:
    diffs: dict[int, float] = state["residual_diffs"]
    if step not in diffs:
        diffs[step] = diff
        if diff > 0.0:
            state["accumulated_diff"] += diff


class DBCache(BlockInterceptor):
    """Dual block cache (cache-dit's DBCache) with per-request, per-branch state."""

    plugin_id: ClassVar[str] = "dbcache"
    config_model: ClassVar[type[BaseModel]] = DBCacheSettings
    request_model: ClassVar[type[BaseModel]] = DBCacheParams
    conflicts_with: ClassVar[frozenset[str]] = frozenset({"fbcache", "taylorseer"})

    def settings(self, params: BaseModel | None) -> DBCacheSettings:
        """The deploy config with a request's overrides applied (validated)."""
        return apply_overrides(self.config, params)  # type: ignore[no-any-return]

    def parse_params(self, raw: dict[str, Any] | None) -> BaseModel:
        params = self.request_model.model_validate(raw or {})
        self.settings(params)  # a ValidationError here names the field, like one from the schema
        return params

    def distribution_altering(self, params: BaseModel) -> bool:
        return self.settings(params).residual_diff_threshold > 0.0

    def run_blocks(
        self, blocks: BlockSequence, hidden: torch.Tensor, state: dict[str, Any], params: BaseModel, call: BlockCall
    ) -> torch.Tensor:
        settings = self.settings(params)
        total = blocks.num_blocks
        if settings.residual_diff_threshold <= 0.0:
            return blocks.run(0, total, hidden)  # never reuses: no bookkeeping on the exact path
        fn, bn = settings.fn_compute_blocks, settings.bn_compute_blocks
        if fn + bn >= total:
            raise InvalidRequest(
                f"plugin_params.{self.plugin_id}.fn_compute_blocks",
                f"Fn ({fn}) + Bn ({bn}) blocks leave no middle block to cache in a {total}-block transformer",
                allowed=f"fn_compute_blocks + bn_compute_blocks <= {total - 1}",
            )
        step = call.step_index
        if not state:
            state.update(cached_steps=[], computed_steps=[], residual_diffs={}, continuous_cached=0, accumulated_diff=0.0)
        cached: list[int] = state["cached_steps"]
        if not cached or cached[-1] != step - 1:  # a computed step ends a reuse streak
            state["continuous_cached"] = 0

        start = hidden
        hidden = blocks.run(0, fn, hidden)
        fn_residual = hidden - start
        if can_reuse(state, settings, step, fn_residual):
            cached.append(step)
            state["continuous_cached"] += 1
            hidden = self.reused_residual(state, settings, step) + hidden
        else:
            state["computed_steps"].append(step)
            state["fn_residual"] = fn_residual
            before = hidden
            hidden = blocks.run(fn, total - bn, hidden)
            self.store_residual(state, settings, step, hidden - before)
        return blocks.run(total - bn, total, hidden)

    # -- what is cached, and how it is reused (TaylorSeer overrides these) ---------------

    def store_residual(self, state: dict[str, Any], settings: DBCacheSettings, step: int, residual: torch.Tensor) -> None:
        state["mn_residual"] = residual

    def reused_residual(self, state: dict[str, Any], settings: DBCacheSettings, step: int) -> torch.Tensor:
        return state["mn_residual"]


class FBCache(DBCache):
    """First block cache (ParaAttention/cache-dit FBCache): DBCache with Fn = 1."""

    plugin_id: ClassVar[str] = "fbcache"
    config_model: ClassVar[type[BaseModel]] = FBCacheSettings
    request_model: ClassVar[type[BaseModel]] = FBCacheParams
    conflicts_with: ClassVar[frozenset[str]] = frozenset({"dbcache", "taylorseer"})


class TaylorSeer(DBCache):
    """DBCache + TaylorSeer: the reused middle residual is a Taylor extrapolation of its history.

    On each computed step the derivative ladder ``[Y, dY, d2Y]`` is refreshed by finite
    differences over the distance (in steps) to the previous computed step; a reused step
    ``e`` steps after the last computed one gets ``sum_i d_iY * e**i / i!``.
    """

    plugin_id: ClassVar[str] = "taylorseer"
    config_model: ClassVar[type[BaseModel]] = TaylorSeerSettings
    request_model: ClassVar[type[BaseModel]] = TaylorSeerParams
    conflicts_with: ClassVar[frozenset[str]] = frozenset({"dbcache", "fbcache"})

    def store_residual(self, state: dict[str, Any], settings: DBCacheSettings, step: int, residual: torch.Tensor) -> None:
        order = settings.taylorseer_order  # type: ignore[attr-defined]
        previous: list[torch.Tensor] = state.get("taylor_ladder", [])
        ladder = [residual]
        if previous:
            window = step - state["taylor_step"]
            for i in range(min(order, len(previous))):
                ladder.append((ladder[i] - previous[i]) / window)
        state["taylor_ladder"] = ladder
        state["taylor_step"] = step

    def reused_residual(self, state: dict[str, Any], settings: DBCacheSettings, step: int) -> torch.Tensor:
        elapsed = step - state["taylor_step"]
        output: Any = 0
        # Same expression and order as cache-dit's TaylorSeerState.approximate, so results match bit for bit.
        for i, derivative in enumerate(state["taylor_ladder"]):
            output = output + (1 / math.factorial(i)) * derivative * (elapsed**i)
        return output
