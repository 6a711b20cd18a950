"""Build a cache from vLLM-style names, with formats (and so bytes) taken from kvlab.plan.

`make_cache("int4", ...)` resolves the name exactly as the planner does ("auto" = the
compute dtype), so the cache a model runs with is the one the planner counted.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvlab.cache.base import CacheError, KVCache, KVShape, Rope, model_dtype_name
from kvlab.cache.codecs import FLOAT_DTYPES, Scale, make_codec
from kvlab.cache.contiguous import ContiguousCache
from kvlab.cache.kivi import KiviCache
from kvlab.cache.latent import LatentCache
from kvlab.cache.quantized import QuantizedCache
from kvlab.plan.kv_formats import FLOAT, KIVI, KVFormat, resolve_kv_format


def kv_format(kv_cache_dtype: str, compute_dtype: torch.dtype = torch.float32, group_size: Optional[int] = None,
              residual: Optional[int] = None) -> KVFormat:
    """The plan's format for a cache name, "auto" meaning the compute dtype."""
    return resolve_kv_format(kv_cache_dtype, model_dtype_name(compute_dtype), group_size, residual)


def make_cache(kv_cache_dtype: str, num_layers: int, batch: int, kv_heads: int, k_head_dim: int, v_head_dim: int,
               max_tokens: int, compute_dtype: torch.dtype = torch.float32, group_size: Optional[int] = None,
               residual: Optional[int] = None, pre_rope: bool = False, rope: Optional[Rope] = None, *,
               k_scale: Scale = 1.0, v_scale: Scale = 1.0, device: torch.device | str | None = None) -> KVCache:
    """The lab's reference cache for `kv_cache_dtype`: float/fp8 contiguous (preallocated), int8/4/2
    growing, or KIVI growing with its residual. What serves is the paged pool (kvlab.cache.pool);
    these are written independently of it, and tests hold the pool to them.

    k_scale/v_scale: fp8's static scales, a float (per tensor) or one per KV head.
    """
    fmt = kv_format(kv_cache_dtype, compute_dtype, group_size, residual)
    shape = KVShape(num_layers, batch, kv_heads, k_head_dim, v_head_dim, max_tokens)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, (int, float)) and torch.as_tensor(scale).numel() not in (1, kv_heads):
            raise CacheError(f"{name} needs one value or one per KV head ({kv_heads}), "
                             f"got {torch.as_tensor(scale).numel()}")
    common = dict(compute_dtype=compute_dtype, pre_rope=pre_rope, rope=rope, device=device)
    if fmt.scheme == KIVI:
        cache: KVCache = KiviCache(shape, fmt, **common)
    else:
        k_codec, v_codec = make_codec(fmt, k_head_dim, k_scale), make_codec(fmt, v_head_dim, v_scale)
        if fmt.scheme == FLOAT:
            cache = ContiguousCache(shape, k_codec, v_codec, **common)
        else:
            cache = QuantizedCache(shape, k_codec, v_codec, **common)
    cache.kv_format = fmt
    return cache


def make_latent_cache(kv_cache_dtype: str, num_layers: int, batch: int, kv_lora_rank: int, rope_dim: int,
                      max_tokens: int, compute_dtype: torch.dtype = torch.float32, *, scale: float = 1.0,
                      device: torch.device | str | None = None) -> LatentCache:
    """An MLA latent cache in a float format (fp32/fp16/bf16/fp8, "auto" = compute dtype)."""
    fmt = kv_format(kv_cache_dtype, compute_dtype)
    if fmt.scheme != FLOAT:
        raise CacheError(f"the MLA latent cache stores float formats only ({', '.join(FLOAT_DTYPES)}, fp8), "
                         f"not {fmt.name}")
    cache = LatentCache(num_layers, batch, kv_lora_rank, rope_dim, max_tokens,
                        make_codec(fmt, kv_lora_rank + rope_dim, scale), compute_dtype, device)
    cache.kv_format = fmt
    return cache
