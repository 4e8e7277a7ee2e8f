"""fv-cachedit: block caches (DBCache, FBCache, TaylorSeer) and a step-skip cache as fv interceptors.

Every cache keeps its state in the request's ``LoopState.plugin_state``, so requests that
share a model and interleave step by step cannot corrupt each other's caches.
"""

from fv_cachedit.block_cache import (
    DBCache,
    DBCacheParams,
    DBCacheSettings,
    FBCache,
    FBCacheParams,
    FBCacheSettings,
    TaylorSeer,
    TaylorSeerParams,
    TaylorSeerSettings,
)
from fv_cachedit.stats import BranchCacheStats, block_cache_stats
from fv_cachedit.step_cache import StepSkip, StepSkipParams, StepSkipSettings

__all__ = [
    "DBCache",
    "DBCacheParams",
    "DBCacheSettings",
    "FBCache",
    "FBCacheParams",
    "FBCacheSettings",
    "TaylorSeer",
    "TaylorSeerParams",
    "TaylorSeerSettings",
    "StepSkip",
    "StepSkipParams",
    "StepSkipSettings",
    "BranchCacheStats",
    "block_cache_stats",
]
