"""Reading a finished loop's cache state: which steps reused, which computed, and the diffs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["BranchCacheStats", "block_cache_stats"]


@dataclass(frozen=True)
class BranchCacheStats:
    """One CFG branch of one loop under a block cache."""

    computed_steps: tuple[int, ...]
    cached_steps: tuple[int, ...]
    residual_diffs: dict[int, float] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.computed_steps) + len(self.cached_steps)

    @property
    def skip_rate(self) -> float:
        """Share of this branch's steps whose middle blocks were reused."""
        return len(self.cached_steps) / self.steps if self.steps else 0.0


def block_cache_stats(plugin_state: Mapping[str, Mapping[str, Any]]) -> dict[str, BranchCacheStats]:
    """``LoopState.plugin_state[plugin_id]`` -> per-branch stats (empty when the cache never ran its bookkeeping)."""
    return {
        branch: BranchCacheStats(
            computed_steps=tuple(state.get("computed_steps", ())),
            cached_steps=tuple(state.get("cached_steps", ())),
            residual_diffs=dict(state.get("residual_diffs", {})),
        )
        for branch, state in plugin_state.items()
    }
