"""The smallest pool that holds a known workload: what `kvlab generate` and `kvlab measure` run on.

A command that decodes a fixed batch (B sequences of T tokens) needs no pool sized from the
machine's memory: it takes exactly the blocks those sequences can hold at once (kvlab.cache.
kv_groups: every block of a full group, a windowed group's window and one chunk), at the
plan's bytes per block (kvlab.plan.pool_capacity), so its pool's bytes are the plan's for
that batch and nothing more.
"""

from __future__ import annotations

from kvlab.cache.base import model_dtype_name
from kvlab.cache.kv_groups import model_groups
from kvlab.cache.pool import layer_groups
from kvlab.plan.capacity import cache_formats
from kvlab.plan.pool_capacity import engine_capacity, seat_bytes, uses_seats


def budget_for(model, kv_cache_dtype: str, sequences: int, tokens: int, block_size: int, chunk: int) -> int:
    """Bytes of the smallest pool in which `sequences` sequences of `tokens` tokens run at once."""
    config = model.config
    formats = cache_formats(kv_cache_dtype, model_dtype=model_dtype_name(model.dtype))
    spec = config.to_plan_spec()
    seats = sequences if uses_seats(formats) else 0
    capacity = engine_capacity(spec, 0, tokens, formats, block_size, seats, chunk)
    groups = model_groups(config.sliding_windows, layer_groups(config, block_size))
    blocks = sequences * sum(group.peak_blocks(tokens, chunk, block_size) for group in groups)
    return blocks * capacity["block_bytes_all_layers"] + seats * seat_bytes(spec, formats, tokens) + \
        capacity.get("fixed_bytes", 0)
