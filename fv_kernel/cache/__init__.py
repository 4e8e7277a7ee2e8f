"""The cache plane: typed keys, the feature cache, and the paged KV pool."""

from fv_kernel.cache.feature import CacheStats, FeatureCache
from fv_kernel.cache.keys import CacheKey, content_hash
from fv_kernel.cache.paged_kv import CacheFull, KVBlockTable, PagedKVConfig, PagedKVPool

__all__ = ["CacheKey", "CacheStats", "FeatureCache", "content_hash"]
__all__ += ["CacheFull", "KVBlockTable", "PagedKVConfig", "PagedKVPool"]
