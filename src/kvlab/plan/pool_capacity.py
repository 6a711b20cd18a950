"""The engine's pool from a byte budget: vLLM's arithmetic where vLLM has the format, KIVI's otherwise.

kvlab's engine lays its pool out as vLLM does (kvlab.plan.vllm_blocks), so for every format
vLLM also serves its start-up lines are vLLM's, and `kvlab plan --engine vllm` predicts them.
KIVI (kvlab.cache.kivi_pool) is kvlab's alone: its blocks hold quantised tokens only, and each
of the engine's seats (`max_num_seqs`) keeps a ring of R + G full-precision rows per layer for
its newest tokens. The seats' rings come off the budget first; blocks fill the rest.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvlab.plan.capacity import CacheFormats
from kvlab.plan.errors import PlanError
from kvlab.plan.kv_formats import KIVI
from kvlab.plan.spec import ModelSpec
from kvlab.plan.vllm_blocks import GIB, vllm_capacity


def kivi_block_bytes(spec: ModelSpec, formats: CacheFormats, block_size: int) -> int:
    """Bytes of one block of `block_size` quantised tokens over every layer."""
    k, v = replace(formats.k, residual=0), replace(formats.v, residual=0)
    return sum(k.bytes("k", layer.kv_heads, layer.k_head_dim, block_size)
               + v.bytes("v", layer.kv_heads, layer.v_head_dim, block_size)
               for layer in spec.layers if not layer.kv_shared)


def kivi_seat_bytes(spec: ModelSpec, formats: CacheFormats) -> int:
    """Bytes of one seat's residual rings: R + G full-precision rows of K and V per layer."""
    rows = formats.k.residual + formats.k.group_size
    return sum(rows * layer.kv_heads * (layer.k_head_dim * formats.k.residual_bytes
                                        + layer.v_head_dim * formats.v.residual_bytes)
               for layer in spec.layers if not layer.kv_shared)


def engine_capacity(spec: ModelSpec, available_bytes: int, max_model_len: int, formats: CacheFormats,
                    block_size: int, seats: int, max_num_batched_tokens: int = 2048) -> dict[str, Any]:
    """The engine's blocks and start-up lines for `available_bytes` (see module doc)."""
    if KIVI not in (formats.k.scheme, formats.v.scheme):
        return vllm_capacity(spec, available_bytes, max_model_len, formats, block_size, device="cpu",
                             max_num_batched_tokens=max_num_batched_tokens)
    if formats.k != formats.v:
        raise PlanError("a KIVI pool stores keys and values in one KIVI format")
    if spec.has_mla or spec.has_windows or spec.has_state:
        raise PlanError(f"{formats.k.name} pools serve full-attention K/V layers only")
    block = kivi_block_bytes(spec, formats, block_size)
    residual = seats * kivi_seat_bytes(spec, formats)
    num_blocks = max(0, available_bytes - residual) // block
    tokens = num_blocks * block_size
    concurrency = num_blocks / -(-max_model_len // block_size)
    return {
        "device": "cpu",
        "block_size": block_size,
        "block_bytes_all_layers": block,
        "residual_bytes": residual,
        "seats": seats,
        "num_gpu_blocks": num_blocks,
        "gpu_kv_cache_tokens": tokens,
        "max_concurrency": concurrency,
        "log_lines": [
            f"Available KV cache memory: {available_bytes / GIB:.2f} GiB",
            f"CPU KV cache size: {tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per request: "
            f"{concurrency:.2f}x",
            f"{formats.k.name}: {seats} seats' full-precision residuals of "
            f"{formats.k.residual + formats.k.group_size} tokens take {residual / 2**20:.2f} MiB of it",
        ],
    }
