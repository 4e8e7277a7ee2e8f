"""The cache plane: typed keys, the feature cache, the paged text-KV pool and the slab chunk-KV pool."""

from fv_kernel.cache.feature import CacheStats, FeatureCache
from fv_kernel.cache.keys import CacheKey, content_hash
from fv_kernel.cache.paged_kv import CacheFull, KVBlockTable, PagedKVConfig, PagedKVPool
from fv_kernel.cache.block_pool import BlockPool
from fv_kernel.cache.slab_kv import SlabKVConfig, SlabKVPool, SlabWindow, SlabWindowSpec

__all__ = ["CacheKey", "CacheStats", "FeatureCache", "content_hash"]
__all__ += ["CacheFull", "KVBlockTable", "PagedKVConfig", "PagedKVPool"]
__all__ += ["BlockPool", "SlabKVConfig", "SlabKVPool", "SlabWindow", "SlabWindowSpec"]
