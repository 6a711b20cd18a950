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

A model with sliding layers (Gemma 3) groups its layers as vLLM's hybrid manager does
(kvlab.plan.vllm_groups): a block id is then a page in each of `group_size` layers. Where any
group is windowed (sliding layers, or the sinks + window policy) one request needs each group's
peak pages (its window and the in-flight tokens), and the logged figures follow vLLM 0.32's
(tokens = int(concurrency x max_model_len)). Seats stay per layer: a sliding layer's KIVI ring
and KVQuant sinks and outliers are the same as a full layer's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvlab.plan.capacity import CacheFormats, kv_fixed_bytes
from kvlab.plan.errors import PlanError
from kvlab.plan.kv_formats import KIVI, KVQUANT, SINK_BYTES, kvquant_row_bytes, outlier_bytes, outlier_capacity
from kvlab.plan.spec import ModelSpec
from kvlab.plan.vllm_blocks import GIB, vllm_capacity
from kvlab.plan.vllm_groups import KVGroup, kv_groups
from kvlab.plan.vllm_versions import DEFAULT_VERSION, release

# kvlab's engine defaults (`kvlab serve`'s --block-size and --max-num-seqs), for plans of its pool
DEFAULT_BLOCK_SIZE = 64  # why 64: kvlab.cache.pool
DEFAULT_MAX_NUM_SEQS = 64


def kivi_page_bytes(layer, formats: CacheFormats, block_size: int) -> int:
    """Bytes of one layer's page of `block_size` quantised tokens."""
    k, v = replace(formats.k, residual=0), replace(formats.v, residual=0)
    return (k.bytes("k", layer.kv_heads, layer.k_head_dim, block_size)
            + v.bytes("v", layer.kv_heads, layer.v_head_dim, block_size))


def kivi_block_bytes(spec: ModelSpec, formats: CacheFormats, block_size: int) -> int:
    """Bytes of one block of `block_size` quantised tokens over every layer."""
    return sum(kivi_page_bytes(layer, formats, block_size) for layer in spec.layers if not layer.kv_shared)


def kivi_seat_bytes(spec: ModelSpec, formats: CacheFormats) -> int:
    """Bytes of one seat's residual rings: R + G full-precision rows of K and V per layer."""
    rows = formats.k.residual + formats.k.group_size
    return sum(rows * layer.kv_heads * (layer.k_head_dim * formats.k.residual_bytes
                                        + layer.v_head_dim * formats.v.residual_bytes)
               for layer in spec.layers if not layer.kv_shared)


def kvquant_page_bytes(layer, formats: CacheFormats, block_size: int) -> int:
    """Bytes of one layer's page of `block_size` KVQuant rows (keys and values)."""
    k, v = formats.k, formats.v
    return block_size * layer.kv_heads * (kvquant_row_bytes(layer.k_head_dim, k.bits, k.outlier_percent, "k")
                                          + kvquant_row_bytes(layer.v_head_dim, v.bits, v.outlier_percent, "v"))


def kvquant_block_bytes(spec: ModelSpec, formats: CacheFormats, block_size: int) -> int:
    """Bytes of one block of `block_size` KVQuant rows (keys and values) over every layer."""
    return sum(kvquant_page_bytes(layer, formats, block_size) for layer in spec.layers if not layer.kv_shared)


def layer_groups(spec: ModelSpec, block_size: int) -> list[KVGroup]:
    """The model's KV groups as the engine's pool lays them out: vLLM's hybrid grouping, which depends on
    the layers' kinds and shapes, not on the cache format (kvlab.cache.pool.layer_groups reads the same)."""
    from kvlab.plan.capacity import cache_formats
    return kv_groups(spec, cache_formats("fp16"), block_size, 1, True, release(DEFAULT_VERSION))


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
    if spec.has_mla or spec.has_state:
        raise PlanError(f"{name} pools serve K/V layers only (full attention or sliding windows)")
    kvquant = formats.k.scheme == KVQUANT
    page = kvquant_page_bytes if kvquant else kivi_page_bytes
    residual = seats * seat_bytes(spec, formats, max_model_len)
    fixed = kv_fixed_bytes(spec, formats)
    groups = layer_groups(spec, block_size)
    pages = [page(layer, formats, block_size) for layer in spec.layers if not layer.kv_shared]
    if len(groups) == 1:  # a block is every layer's page
        block = sum(pages)
    elif len(set(pages)) > 1 or len({group.block_size for group in groups}) > 1:
        raise PlanError(f"{name} pools need every layer's page alike; {spec.name}'s layers differ")
    else:  # a block is a page in each of group_size layers
        block = pages[0] * max(group.layers for group in groups)
    num_blocks = max(0, available_bytes - residual - fixed) // block
    if len(groups) == 1 and groups[0].window is None:  # every layer full: a request needs every block of its length
        tokens = num_blocks * block_size
        concurrency = num_blocks / -(-max_model_len // block_size)
    else:  # a windowed group needs only its peak pages (its window and the in-flight tokens)
        in_flight = release(DEFAULT_VERSION).in_flight_tokens("cpu", max_num_batched_tokens)
        concurrency = num_blocks / sum(group.peak_blocks(max_model_len, in_flight) for group in groups)
        tokens = int(concurrency * max_model_len)
    if kvquant:
        seat_line = (f"{name}: {seats} seats' sinks and key outliers for {max_model_len:,} tokens take "
                     f"{residual / 2**20:.2f} MiB of it; codebooks and key ranges {fixed / 2**10:.2f} KiB")
    else:
        seat_line = (f"{name}: {seats} seats' full-precision residuals of "
                     f"{formats.k.residual + formats.k.group_size} tokens take {residual / 2**20:.2f} MiB of it")
    return {
        "device": "cpu",
        "block_size": block_size,
        "kv_cache_groups": [dict(kind=g.kind, window=g.window, layers=g.layers) for g in groups],
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
