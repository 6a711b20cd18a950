"""The lab's cache: a batch of rows on the engine's pool, so the lab runs what the engine serves.

`kvlab eval`, the studies and `kvlab.nn.generate` feed a batch of rows that advance together
(B sequences, T new tokens each). `PooledRows` is that batch on a kvlab.cache.KVPool: row r owns
the blocks r * n .. r * n + n - 1 of each KV group (n blocks hold `capacity` tokens; by default
one block of `capacity` tokens, the contiguous cache as a pool), a KIVI pool's residual sits at
seat r, and each forward pass is one `StepBatch` over those tables: the same description,
forward and formats as an engine step. Nothing is handed back (windowed layers mask what left
their window), so its bytes are the plan's for B x n blocks.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvlab.cache.base import CacheError
from kvlab.cache.pool import KVPool, layer_groups
from kvlab.cache.step import StepBatch


KIVI_ROUNDING = 128  # a KIVI pool's blocks hold whole groups of tokens; 128 is a multiple of any usual group


class PooledRows:
    """`batch` rows of at most `capacity` tokens on `pool` (see the module doc)."""

    def __init__(self, pool: KVPool, batch: int, capacity: int) -> None:
        if batch <= 0 or capacity <= 0:
            raise CacheError(f"a batch of rows needs positive batch and capacity, got {batch} and {capacity}")
        per_row = -(-capacity // pool.block_size)
        need = batch * per_row * len(pool.groups)
        if need > pool.num_blocks:
            raise CacheError(f"{batch} rows of {capacity} tokens need {need} blocks of {pool.block_size}; "
                             f"the pool has {pool.num_blocks}")
        self.pool, self.batch, self.capacity = pool, batch, capacity
        self.tables = [[list(range((g * batch + r) * per_row, (g * batch + r + 1) * per_row)) for r in range(batch)]
                       for g in range(len(pool.groups))]
        self.length = 0

    @classmethod
    def for_model(cls, config, batch: int, capacity: int, kv_cache_dtype: str = "auto",
                  compute_dtype: torch.dtype = torch.float32, group_size: Optional[int] = None,
                  residual: Optional[int] = None, kv_window: Optional[int] = None, sink_tokens: int = 0,
                  block_size: Optional[int] = None) -> "PooledRows":
        """Rows on a pool of exactly the blocks they need, for a kvlab.nn ModelConfig (by default one
        block per row, rounded up to a whole KIVI group)."""
        if block_size is None:
            block_size = -(-capacity // KIVI_ROUNDING) * KIVI_ROUNDING if kv_cache_dtype.startswith("kivi") \
                else capacity
        groups = len(layer_groups(config, block_size, kv_window, sink_tokens))
        blocks = batch * -(-capacity // block_size) * groups
        pool = KVPool.for_model(config, blocks, block_size, kv_cache_dtype, compute_dtype, group_size,
                                kv_window=kv_window, sink_tokens=sink_tokens, seats=batch, residual=residual)
        return cls(pool, batch, capacity)

    @property
    def kv_format(self):
        return self.pool.kv_format

    def seq_len(self, layer_idx: int = 0) -> int:
        """Tokens each row holds."""
        return self.length

    def step(self, new_tokens: int) -> StepBatch:
        """The description of the next forward pass: every row feeds `new_tokens` tokens."""
        if self.length + new_tokens > self.capacity:
            raise CacheError(f"the rows would hold {self.length + new_tokens} tokens, over their capacity of "
                             f"{self.capacity}")
        return StepBatch.build([self.length] * self.batch, [new_tokens] * self.batch, block_size=self.pool.block_size,
                               group_tables=self.tables, seats=list(range(self.batch)))

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens

    def reset(self) -> None:
        """Forget every token (the pool's stale rows are never read)."""
        self.length = 0

    def nbytes(self) -> int:
        return self.pool.nbytes()
