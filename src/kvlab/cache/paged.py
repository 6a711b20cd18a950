"""The paged cache: K and V live in a pool of fixed-size blocks, found through block tables.

As in vLLM, a sequence's cache need not be contiguous, so memory is claimed a block at a
time instead of max_tokens up front. Pools hold [num_blocks, block_size, H, width] per
codec field and layer; every layer shares the block tables (token p sits in the same block
and slot in every layer). By default the pool's tensors grow as blocks are first handed out,
so the cache holds the plan's bytes for (blocks allocated x block_size) tokens; with
`preallocate=True` the whole pool exists from the start, as on a GPU sized at startup.
"""

from __future__ import annotations

from itertools import chain
from typing import Iterator, Optional

import torch
from torch import Tensor

from kvlab.cache.base import CacheError, KVCache, KVShape, Rope
from kvlab.cache.blocks import BlockAllocator, BlockTables
from kvlab.cache.codecs import RowCodec

Pool = dict[str, Tensor]  # codec field name -> [num_blocks, block_size, H, width]


class PagedCache(KVCache):
    """Per-token rows (any row codec) in a block pool with one block table per batch row."""

    def __init__(self, shape: KVShape, k_codec: RowCodec, v_codec: RowCodec,
                 compute_dtype: torch.dtype = torch.float32, pre_rope: bool = False,
                 rope: Optional[Rope] = None, device: torch.device | str | None = None,
                 block_size: int = 16, num_blocks: Optional[int] = None, preallocate: bool = False) -> None:
        super().__init__(shape, compute_dtype, pre_rope, rope, device)
        if not isinstance(block_size, int) or block_size <= 0:
            raise CacheError(f"block_size must be a positive integer, got {block_size!r}")
        self.codecs = (k_codec, v_codec)
        self.block_size = block_size
        self.num_blocks = num_blocks if num_blocks is not None else shape.batch * -(-shape.max_tokens // block_size)
        self.preallocate = preallocate
        self._empty_pools()
        self._clear()
        if preallocate:
            self._grow(self.num_blocks)

    def can_append(self, num_new_tokens: int, layer_idx: int = 0) -> bool:
        """Whether the pool has blocks for every sequence to take `num_new_tokens` more in this layer."""
        return self.block_tables.can_append(self.seq_len(layer_idx) + num_new_tokens)

    @property
    def blocks_in_use(self) -> int:
        return self.allocator.num_blocks - self.allocator.num_free

    def _store(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        end = start + k.shape[2]
        self.block_tables.append(end)  # the first layer to reach `end` claims the blocks for all
        self._grow(self.allocator.high_water)
        positions = torch.arange(start, end, device=self.device)
        tables = self._tables_tensor(end)
        blocks = tables[:, positions // self.block_size]  # [B, T_new]
        slots = (positions % self.block_size).expand_as(blocks)
        for pool, codec, x in ((self.k_pools[layer], self.codecs[0], k), (self.v_pools[layer], self.codecs[1], v)):
            for name, field in codec.encode(x).items():
                pool[name][blocks, slots] = field.transpose(1, 2).to(self.device)  # [B, T_new, H, width]

    def _load(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        tables = self._tables_tensor(end)
        k = self._gather(self.k_pools[layer], self.codecs[0], tables, end)
        v = self._gather(self.v_pools[layer], self.codecs[1], tables, end)
        return k, v

    def _gather(self, pool: Pool, codec: RowCodec, tables: Tensor, end: int) -> Tensor:
        """A sequence's rows, block by block: [B, blocks, block_size, H, w] -> [B, H, end, w]."""
        fields = {name: blocks[tables].flatten(1, 2)[:, :end].transpose(1, 2) for name, blocks in pool.items()}
        return codec.decode(fields, self.compute_dtype)

    def _tables_tensor(self, tokens: int) -> Tensor:
        used = self.allocator.blocks_for(tokens)
        return torch.tensor([table[:used] for table in self.block_tables.tables], dtype=torch.long,
                            device=self.device)

    def _grow(self, blocks: int) -> None:
        """Make every pool hold at least `blocks` blocks (lazy pools grow as ids are handed out)."""
        have = next(iter(self.k_pools[0].values())).shape[0]
        if blocks <= have:
            return
        for pool in self.k_pools + self.v_pools:
            for name, tensor in pool.items():
                extra = tensor.new_zeros((blocks - have,) + tuple(tensor.shape[1:]))
                pool[name] = torch.cat([tensor, extra])

    def _empty_pool(self, codec: RowCodec) -> Pool:
        return {name: torch.zeros(0, self.block_size, self.shape.kv_heads, width, dtype=dtype, device=self.device)
                for name, (width, dtype) in codec.fields().items()}

    def tensors(self) -> Iterator[Tensor]:
        return chain.from_iterable(pool.values() for pool in self.k_pools + self.v_pools)

    def _clear(self) -> None:
        """Free every block; a lazy pool also gives its storage back, a preallocated one keeps it."""
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)
        self.block_tables = BlockTables(self.allocator, self.shape.batch)
        if not self.preallocate:
            self._empty_pools()

    def _empty_pools(self) -> None:
        self.k_pools = [self._empty_pool(self.codecs[0]) for _ in range(self.num_layers)]
        self.v_pools = [self._empty_pool(self.codecs[1]) for _ in range(self.num_layers)]
