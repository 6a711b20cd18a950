"""KV caches: contiguous, paged (block pool), group-quantised int8/4/2, KIVI 2/4-bit, MLA latent.

Every cache's `nbytes()` equals kvlab.plan's figure for what it holds, byte for byte.
"""

from kvlab.cache.base import CacheError, CacheStore, KVCache, KVShape
from kvlab.cache.blocks import BlockAllocator, BlockTables
from kvlab.cache.contiguous import ContiguousCache
from kvlab.cache.factory import kv_format, make_cache, make_latent_cache
from kvlab.cache.kivi import KiviCache
from kvlab.cache.latent import LatentCache
from kvlab.cache.paged import PagedCache
from kvlab.cache.quantized import QuantizedCache

__all__ = [
    "BlockAllocator", "BlockTables", "CacheError", "CacheStore", "ContiguousCache", "KVCache", "KVShape",
    "KiviCache", "LatentCache", "PagedCache", "QuantizedCache", "kv_format", "make_cache", "make_latent_cache",
]
