"""Block bookkeeping and the paged pool: paired checks and actions, exhaustion, release."""

from __future__ import annotations

import pytest
import torch

from cache_helpers import plan_nbytes
from kvlab.cache import BlockAllocator, BlockTables, CacheError, make_cache


def test_allocator_pairs_check_and_action_and_hands_out_lowest_ids() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    assert allocator.blocks_for(0) == 0 and allocator.blocks_for(16) == 1 and allocator.blocks_for(17) == 2
    assert allocator.can_allocate(3)
    assert allocator.allocate(3) == [0, 1, 2]
    assert not allocator.can_allocate(2)
    with pytest.raises(CacheError, match="exhausted"):
        allocator.allocate(2)
    allocator.free([1, 0])
    assert allocator.allocate(2) == [0, 1]
    assert allocator.high_water == 3


def test_block_tables_grow_all_sequences_or_none() -> None:
    tables = BlockTables(BlockAllocator(num_blocks=5, block_size=4), num_seqs=2)
    tables.append(5)  # 2 blocks each
    assert [len(t) for t in tables.tables] == [2, 2]
    assert not tables.can_append(9)  # would need 2 more, 1 free
    with pytest.raises(CacheError, match="2 sequences of 9 tokens need 2 more blocks, 1 of 5"):
        tables.append(9)
    assert [len(t) for t in tables.tables] == [2, 2]
    tables.free_all()
    assert tables.allocator.num_free == 5


def test_paged_cache_refuses_to_overrun_its_pool() -> None:
    cache = make_cache("auto", 2, 2, 1, 8, 8, 64, paged=True, block_size=4, num_blocks=5)
    k = torch.randn(2, 1, 8, 8)
    cache.update(0, k, k)
    assert cache.blocks_in_use == 4 and cache.can_append(4) is False and cache.can_append(0)
    with pytest.raises(CacheError, match="exhausted"):
        cache.update(0, k[:, :, :1], k[:, :, :1])


def test_preallocated_pool_holds_every_block_from_the_start() -> None:
    cache = make_cache("fp16", 2, 2, 3, 8, 4, 64, paged=True, block_size=4, num_blocks=10, preallocate=True)
    whole_pool = plan_nbytes("fp16", 10 * 4, 1, 2, 3, 8, 4)  # 40 token slots shared by the batch
    assert cache.nbytes() == whole_pool
    cache.update(0, torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 4))
    cache.reset()
    assert cache.nbytes() == whole_pool and cache.blocks_in_use == 0


def test_layers_share_block_tables() -> None:
    """The first layer to need a block claims it for all layers; later layers reuse it."""
    cache = make_cache("auto", 3, 1, 1, 4, 4, 32, paged=True, block_size=4)
    k = torch.randn(1, 1, 6, 4)
    cache.update(0, k, k)
    used = cache.blocks_in_use
    cache.update(1, k, k)
    cache.update(2, k, k)
    assert cache.blocks_in_use == used == 2
