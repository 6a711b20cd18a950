"""What vLLM would print at start-up for the same budget: capacity rounded to whole blocks.

vLLM pages the cache in blocks of `block_size` tokens on every layer:
num_blocks = available_bytes // (sum over layers of block_size x bytes per token per layer),
GPU KV cache size = num_blocks x block_size tokens, and maximum concurrency = that / max_model_len.
"""

from __future__ import annotations

from typing import Any

from kvlab.plan.capacity import CacheFormats, layer_kv_bytes
from kvlab.plan.errors import PlanError
from kvlab.plan.kv_formats import KIVI
from kvlab.plan.spec import ModelSpec

GIB = 2**30


def vllm_capacity(spec: ModelSpec, available_bytes: int, max_model_len: int, formats: CacheFormats,
                  block_size: int = 16, tensor_parallel: int = 1) -> dict[str, Any]:
    """vLLM's block arithmetic and its start-up log lines for `available_bytes` of cache memory."""
    if KIVI in (formats.k.scheme, formats.v.scheme):
        raise PlanError("vLLM has no KIVI cache; use --engine kvlab for kivi2/kivi4")
    page_bytes = sum(block_size * layer_kv_bytes(layer, 1, formats, tensor_parallel) for layer in spec.layers)
    num_blocks = max(0, available_bytes) // page_bytes
    tokens = num_blocks * block_size
    concurrency = tokens / max_model_len
    return {
        "block_size": block_size,
        "block_bytes_all_layers": page_bytes,
        "num_gpu_blocks": num_blocks,
        "gpu_kv_cache_tokens": tokens,
        "max_concurrency": concurrency,
        "log_lines": [
            f"Available KV cache memory: {available_bytes / GIB:.2f} GiB",
            f"GPU KV cache size: {tokens:,} tokens",
            f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x",
        ],
    }
