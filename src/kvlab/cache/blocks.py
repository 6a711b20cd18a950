"""Block bookkeeping for paged caches, after vLLM's (and nano-vllm's) block manager.

A pool of `num_blocks` blocks, each `block_size` token slots; every sequence owns a block
table listing its blocks in order, so token p of a sequence lives in slot p % block_size of
block table[p // block_size]. Pure Python: it knows block ids, never tensors, so the engine's
scheduler can ask it questions without touching the GPU. Every action has its check:
`can_allocate`/`allocate`, `can_append`/`append`.
"""

from __future__ import annotations

import heapq

from kvlab.cache.base import CacheError


class BlockAllocator:
    """Free and used block ids of one pool; always hands out the lowest free ids.

    Lowest-first keeps a lazily grown pool as short as the blocks in use allow.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise CacheError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap; sorted is already one
        self.high_water = 0  # 1 + the largest id ever handed out: the blocks a lazy pool must hold

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise CacheError(f"KV block pool exhausted: need {n} free blocks, {self.num_free} of {self.num_blocks} left")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self.high_water = max([self.high_water] + [i + 1 for i in ids])
        return ids

    def free(self, ids: list[int]) -> None:
        for block in ids:
            heapq.heappush(self._free, block)


class BlockTables:
    """One block table per sequence, drawing on a shared allocator."""

    def __init__(self, allocator: BlockAllocator, num_seqs: int) -> None:
        self.allocator = allocator
        self.tables: list[list[int]] = [[] for _ in range(num_seqs)]

    def missing_blocks(self, seq: int, tokens: int) -> int:
        """Blocks sequence `seq` still needs to hold `tokens` tokens."""
        return max(0, self.allocator.blocks_for(tokens) - len(self.tables[seq]))

    def can_append(self, tokens: int) -> bool:
        """Whether every sequence can grow to `tokens` tokens from the free blocks."""
        need = sum(self.missing_blocks(seq, tokens) for seq in range(len(self.tables)))
        return self.allocator.can_allocate(need)

    def append(self, tokens: int) -> None:
        """Give every sequence the blocks to hold `tokens` tokens (all or nothing)."""
        needs = [self.missing_blocks(seq, tokens) for seq in range(len(self.tables))]
        if not self.allocator.can_allocate(sum(needs)):
            raise CacheError(f"KV block pool exhausted: {len(self.tables)} sequences of {tokens} tokens need "
                             f"{sum(needs)} more blocks, {self.allocator.num_free} of {self.allocator.num_blocks} "
                             "are free (raise num_blocks or lower the batch or context)")
        for table, need in zip(self.tables, needs):
            table.extend(self.allocator.allocate(need))

    def free_all(self) -> None:
        for table in self.tables:
            self.allocator.free(table)
            table.clear()
