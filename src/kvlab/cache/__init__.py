"""KV caches: the paged pool every command runs on (KV groups, per-token formats, KIVI, MLA latents),
the lab's batch of rows on it, and the lab's reference caches (contiguous, group-quantised, KIVI,
windows, MLA latent, KVQuant) that tests hold the pool to.

Every cache's `nbytes()` equals kvlab.plan's figure for what it holds, byte for byte.
"""

from kvlab.cache.base import CacheError, CacheStore, KVCache, KVShape
from kvlab.cache.contiguous import ContiguousCache
from kvlab.cache.factory import kv_format, make_cache, make_latent_cache
from kvlab.cache.kivi import KiviCache
from kvlab.cache.latent import LatentCache
from kvlab.cache.pool import KVPool
from kvlab.cache.pooled_rows import PooledRows
from kvlab.cache.quantized import QuantizedCache

__all__ = [
    "CacheError", "CacheStore", "ContiguousCache", "KVCache", "KVPool", "KVShape", "KiviCache", "LatentCache",
    "PooledRows", "QuantizedCache", "kv_format", "make_cache", "make_latent_cache",
]
