"""The engine's pool from a byte budget: vLLM's arithmetic where vLLM has the format, kvlab's otherwise.

kvlab's engine lays its pool out as vLLM does (kvlab.plan.vllm_blocks), so for every format
vLLM also serves its start-up lines are vLLM's, and `kvlab plan --engine vllm` predicts them.
KIVI and KVQuant are kvlab's alone, and each keeps some state per seat (one of the engine's
`max_num_seqs` places for a running sequence), taken off the budget first; blocks fill the rest:
- KIVI (kvlab.cache.kivi_pool): blocks hold quantised tokens only; a seat keeps a ring of R + G
  full-precision rows per layer for its newest tokens.
- KVQuant (kvlab.cache.kvquant_pool): blocks hold one row per token (kvquant_row_bytes, keys and
  values); a seat keeps the sequence's sink tokens in fp16 and its keys' outlier pool, sized for
  `max_model_len` tokens: outlier_capacity(max_model_len - sinks) slots per head, as the plan
  counts a sequence of that length. The codebooks and key ranges (fixed_bytes) come off once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvlab.plan.capacity import CacheFormats, kv_fixed_bytes
from kvlab.plan.errors import PlanError
from kvlab.plan.kv_formats import KIVI, KVQUANT, SINK_BYTES, kvquant_row_bytes, outlier_bytes, outlier_capacity
from kvlab.plan.spec import ModelSpec
from kvlab.plan.vllm_blocks import GIB, vllm_capacity

# kvlab's engine defaults (`kvlab serve`'s --block-size and --max-num-seqs), for plans of its pool
DEFAULT_BLOCK_SIZE = 64  # why 64: kvlab.cache.pool
DEFAULT_MAX_NUM_SEQS = 64


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


def kvquant_block_bytes(spec: ModelSpec, formats: CacheFormats, block_size: int) -> int:
    """Bytes of one block of `block_size` KVQuant rows (keys and values) over every layer."""
    k, v = formats.k, formats.v
    return sum(block_size * layer.kv_heads * (kvquant_row_bytes(layer.k_head_dim, k.bits, k.outlier_percent, "k")
                                              + kvquant_row_bytes(layer.v_head_dim, v.bits, v.outlier_percent, "v"))
               for layer in spec.layers if not layer.kv_shared)


def kvquant_seat_bytes(spec: ModelSpec, formats: CacheFormats, max_model_len: int) -> int:
    """Bytes of one seat: its sink tokens (K and V in fp16) and its keys' outlier pool for max_model_len tokens."""
    k = formats.k
    rows = max(0, max_model_len - k.sink_tokens)
    return sum(k.sink_tokens * layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * SINK_BYTES
               + layer.kv_heads * outlier_capacity(rows, layer.k_head_dim, k.outlier_percent)
               * outlier_bytes(layer.k_head_dim)
               for layer in spec.layers if not layer.kv_shared)


def seat_bytes(spec: ModelSpec, formats: CacheFormats, max_model_len: int) -> int:
    """One seat's bytes for a format that keeps state per seat (0 for the others)."""
    if formats.k.scheme == KIVI:
        return kivi_seat_bytes(spec, formats)
    if formats.k.scheme == KVQUANT:
        return kvquant_seat_bytes(spec, formats, max_model_len)
    return 0


def uses_seats(formats: CacheFormats) -> bool:
    """Whether the pool keeps state per seat (KIVI's residual rings, KVQuant's sinks and outliers)."""
    return formats.k.scheme in (KIVI, KVQUANT) or formats.v.scheme in (KIVI, KVQUANT)


def engine_capacity(spec: ModelSpec, available_bytes: int, max_model_len: int, formats: CacheFormats,
                    block_size: int, seats: int, max_num_batched_tokens: int = 2048) -> dict[str, Any]:
    """The engine's blocks and start-up lines for `available_bytes` (see module doc)."""
    if not uses_seats(formats):
        return vllm_capacity(spec, available_bytes, max_model_len, formats, block_size, device="cpu",
                             max_num_batched_tokens=max_num_batched_tokens)
    name = formats.k.name
    if formats.k != formats.v:
        raise PlanError(f"a {name} pool stores keys and values in one format")
    if spec.has_mla or spec.has_windows or spec.has_state:
        raise PlanError(f"{name} pools serve full-attention K/V layers only")
    kvquant = formats.k.scheme == KVQUANT
    block = kvquant_block_bytes(spec, formats, block_size) if kvquant else kivi_block_bytes(spec, formats, block_size)
    residual = seats * seat_bytes(spec, formats, max_model_len)
    fixed = kv_fixed_bytes(spec, formats)
    num_blocks = max(0, available_bytes - residual - fixed) // block
    tokens = num_blocks * block_size
    concurrency = num_blocks / -(-max_model_len // block_size)
    if kvquant:
        seat_line = (f"{name}: {seats} seats' sinks and key outliers for {max_model_len:,} tokens take "
                     f"{residual / 2**20:.2f} MiB of it; codebooks and key ranges {fixed / 2**10:.2f} KiB")
    else:
        seat_line = (f"{name}: {seats} seats' full-precision residuals of "
                     f"{formats.k.residual + formats.k.group_size} tokens take {residual / 2**20:.2f} MiB of it")
    return {
        "device": "cpu",
        "block_size": block_size,
        "block_bytes_all_layers": block,
        "residual_bytes": residual,
        "seat_bytes": residual // seats if seats else seat_bytes(spec, formats, max_model_len),
        "fixed_bytes": fixed,
        "seats": seats,
        "num_gpu_blocks": num_blocks,
        "gpu_kv_cache_tokens": tokens,
        "max_concurrency": concurrency,
        "log_lines": [
            f"Available KV cache memory: {available_bytes / GIB:.2f} GiB",
            f"CPU KV cache size: {tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per request: "
            f"{concurrency:.2f}x",
            seat_line,
        ],
    }
