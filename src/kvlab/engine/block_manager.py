"""Per-sequence block tables over one pool, one table per KV group, with ref-counts and prefix caching.

The pool (kvlab.cache.KVPool) only stores tensors; which blocks a sequence owns, how many
sequences share a block and which prompt prefix a block holds live here, in pure Python.
A model's layers form KV groups (kvlab.cache.kv_groups: full attention, sliding windows, the
sinks + window policy); each sequence holds one block table per group, every table drawing
on one free list, as in vLLM's hybrid KV-cache manager. Tables of one sequence always have
the same length (the logical blocks its tokens span); in a windowed group the entries no
later query can see are handed back after each step (`release_outside_window`) and read
RELEASED.

Admission finds a request's cached prefix once and takes its blocks all or nothing
(`admit`, vLLM v1's allocate_slots); a running sequence grows by `allocate_slots`, which
also takes nothing when it cannot take everything.

Prefix caching (vLLM's automatic prefix caching): a full block is named by a hash chained
from the first token, hash(previous block's hash, this block's token ids), and confirmed by
comparing the token ids themselves, so a collision can never serve the wrong K/V. Each group
names its own blocks. A prefix of n blocks is a hit when every full-attention group holds all
n and every windowed group the blocks its next query sees (its sinks' blocks and its last
window): a sliding layer never needs what left its window. A block whose last user leaves
keeps its name and joins the back of the free queue: allocation takes from the front, so
freed blocks are reused least recently freed first, and a prefix that arrives again before
its blocks are taken is served from the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence as Seq

from kvlab.cache.base import CacheError
from kvlab.cache.kv_groups import RELEASED, KVGroup
from kvlab.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[int] = None
        self.token_ids: tuple[int, ...] = ()
        self.group = 0  # the KV group whose prefix the block's name refers to


def chain_hash(previous: Optional[int], token_ids: tuple[int, ...]) -> int:
    """A full block's name: its tokens and everything before them (Python's tuple hash is stable for ints)."""
    return hash((previous, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: Optional[Seq[KVGroup]] = None, seats: int = 0) -> None:
        """`seats` > 0: each admitted sequence also takes one of that many seats (a KIVI pool's
        residual rows), given back when it leaves."""
        if num_blocks <= 0 or block_size <= 0:
            raise CacheError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.groups = list(groups) if groups else [KVGroup(())]
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_seats = list(range(seats - 1, -1, -1))  # popped from the end: seat 0 first
        self.uses_seats = seats > 0
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.by_hash: list[dict[int, int]] = [{} for _ in self.groups]
        self.hash_chains: dict[str, list[int]] = {}  # request id -> hashes of its full blocks, in order
        self.released_upto: dict[str, list[int]] = {}  # request id -> per group, the blocks below were checked
        self.prefix_queries = 0  # prompt tokens looked up in the cache (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of which found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_free(self) -> int:
        """Blocks no running sequence holds (cached prefixes among them: they are reclaimable)."""
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def peak_blocks(self, tokens: int, chunk: int) -> int:
        """Blocks a sequence of `tokens` tokens can hold at once, over its groups, when a step feeds
        at most `chunk` tokens (kvlab.cache.kv_groups.KVGroup.peak_blocks)."""
        return sum(group.peak_blocks(tokens, chunk, self.block_size) for group in self.groups)

    # -- admission ---------------------------------------------------------------------------------

    def _prefix_hit(self, seq: Sequence) -> tuple[int, list[list[int]]]:
        """The longest cached prefix of `seq` in whole blocks (never its last token, whose logits are
        needed) and each group's table for it (RELEASED where a windowed group needs no block)."""
        empty: list[list[int]] = [[] for _ in self.groups]
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0, empty  # a request asking for prompt log-probabilities reads every prompt row itself
        ids, previous, names = seq.all_ids, None, []
        for b in range((len(ids) - 1) // self.block_size):
            tokens = tuple(ids[b * self.block_size:(b + 1) * self.block_size])
            previous = chain_hash(previous, tokens)
            names.append((previous, tokens))

        def cached(g: int, b: int) -> Optional[int]:
            block_id = self.by_hash[g].get(names[b][0])
            return block_id if block_id is not None and self.blocks[block_id].token_ids == names[b][1] else None

        limit = len(names)
        for g, group in enumerate(self.groups):  # a full group bounds the hit: it needs every block
            if not group.windowed:
                limit = next((b for b in range(limit) if cached(g, b) is None), limit)
        for n in range(limit, 0, -1):
            tables = []
            for g, group in enumerate(self.groups):
                if not group.windowed:
                    tables.append([cached(g, b) for b in range(n)])
                    continue
                needed = set(range(self.blocks_for(group.sinks))) | set(group.needed_blocks(n * self.block_size,
                                                                                          self.block_size))
                table = [cached(g, b) if b in needed else RELEASED for b in range(n)]
                if None in table:
                    break
                tables.append(table)
            else:
                return n * self.block_size, tables
        return 0, empty

    def admit(self, seq: Sequence, budget: int) -> Optional[int]:
        """Admit a waiting `seq`: its cached prefix, then blocks for its next chunk of at most
        `budget` tokens, all or nothing. The tokens it feeds this step, or None (nothing taken)
        when the free blocks do not reach."""
        if any(seq.block_tables):
            raise CacheError(f"request {seq.request_id} already holds blocks")
        cached, tables = self._prefix_hit(seq)
        n = min(seq.num_tokens - cached, budget)
        taken = [block_id for table in tables for block_id in table if block_id != RELEASED]
        reusable_free = sum(1 for block_id in set(taken) if self.blocks[block_id].ref_count == 0)
        need = (self.blocks_for(cached + n) - self.blocks_for(cached)) * self.num_groups
        if n <= 0 or need > self.num_free - reusable_free or (self.uses_seats and not self.free_seats):
            return None
        if self.uses_seats:
            seq.seat = self.free_seats.pop()
        for block_id in taken:
            self._take(block_id)
        seq.block_tables = tables
        seq.num_computed = cached
        seq.draft_computed = 0  # a draft model recomputes its own K/V for cached blocks
        self.prefix_queries += len(seq.prompt_ids)
        self.prefix_hits += min(cached, len(seq.prompt_ids))
        seq.num_cached_prompt = min(cached, len(seq.prompt_ids))
        self.hash_chains[seq.request_id] = self._chain(seq, cached // self.block_size)
        self.released_upto[seq.request_id] = [0] * self.num_groups
        self._extend(seq, need // self.num_groups)
        return n

    def _chain(self, seq: Sequence, blocks: int) -> list[int]:
        chain: list[int] = []
        for b in range(blocks):
            chain.append(chain_hash(chain[-1] if chain else None,
                                    tuple(seq.all_ids[b * self.block_size:(b + 1) * self.block_size])))
        return chain

    # -- growth ------------------------------------------------------------------------------------

    def missing(self, seq: Sequence, new_tokens: int) -> int:
        """Free blocks `seq` needs, over all its groups, to feed `new_tokens` more tokens."""
        have = len(seq.block_tables[0]) if seq.block_tables else 0
        return max(0, self.blocks_for(seq.num_computed + new_tokens) - have) * self.num_groups

    def allocate_slots(self, seq: Sequence, new_tokens: int) -> bool:
        """Blocks for `new_tokens` more tokens of a running `seq`, all or nothing: False (nothing
        taken) when the free blocks do not reach."""
        need = self.missing(seq, new_tokens)
        if need > self.num_free:
            return False
        self._extend(seq, need // self.num_groups)
        return True

    def _extend(self, seq: Sequence, per_group: int) -> None:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.groups]
        for table in seq.block_tables:
            for _ in range(per_group):
                block_id = next(iter(self.free_ids))
                self._forget(self.blocks[block_id])  # evict the least recently freed cached block
                self._take(block_id)
                table.append(block_id)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """After a step: name the blocks that just became full, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        chain = self.hash_chains.setdefault(seq.request_id, [])
        ids = seq.all_ids
        # With speculation, num_computed already counts accepted drafts that are appended to
        # the sequence only after this call: a block is named once all its tokens are there.
        while len(chain) < min(seq.num_computed, len(ids)) // self.block_size:
            b = len(chain)
            tokens = tuple(ids[b * self.block_size:(b + 1) * self.block_size])
            h = chain_hash(chain[-1] if chain else None, tokens)
            for g, table in enumerate(seq.block_tables):
                if table[b] == RELEASED:  # handed back (out of the window): nothing to name
                    continue
                block = self.blocks[table[b]]
                if block.hash is None:
                    block.hash, block.token_ids, block.group = h, tokens, g
                    self.by_hash[g].setdefault(h, block.block_id)
            chain.append(h)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix that no running sequence holds (vLLM's reset_prefix_cache), so
        that a benchmark's next run starts cold; returns how many blocks were forgotten. Blocks in
        use keep their names and are cached again when freed."""
        return sum(self._forget(self.blocks[block_id]) for block_id in self.free_ids)

    def _forget(self, block: Block) -> bool:
        """Drop a free block's prefix name, if it has one; whether it had."""
        if block.hash is None:
            return False
        if self.by_hash[block.group].get(block.hash) == block.block_id:
            del self.by_hash[block.group][block.hash]
        block.hash, block.token_ids = None, ()
        return True

    # -- release -----------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq`; shared ones only lose a reference. Idempotent per sequence."""
        for table in seq.block_tables:
            for block_id in reversed(table):  # the tail first: it is the least likely to be shared
                if block_id != RELEASED:
                    self._drop(block_id)
        seq.block_tables = []
        seq.num_computed = seq.draft_computed = 0
        if seq.seat is not None:
            self.free_seats.append(seq.seat)
            seq.seat = None
        self.hash_chains.pop(seq.request_id, None)
        self.released_upto.pop(seq.request_id, None)

    def release_outside_window(self, seq: Sequence) -> int:
        """Hand back, in each windowed group, the blocks of `seq` no query at num_computed or later
        sees (past its sinks, before its window). Returns how many were released."""
        released = 0
        checked = self.released_upto.setdefault(seq.request_id, [0] * self.num_groups)
        for g, (group, table) in enumerate(zip(self.groups, seq.block_tables)):
            if not group.windowed:
                continue
            start = max(checked[g], self.blocks_for(group.sinks))
            end = min(len(table), group.first_visible(seq.num_computed) // self.block_size)
            for b in range(start, end):
                if table[b] != RELEASED:
                    self._drop(table[b])
                    table[b] = RELEASED
                    released += 1
            checked[g] = max(checked[g], end)
        return released

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds now, over all its groups (its tables less the released entries)."""
        return sum(1 for table in seq.block_tables for block_id in table if block_id != RELEASED)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the last valid token (a speculative step's rejected drafts)."""
        keep = self.blocks_for(seq.num_computed)
        for table in seq.block_tables:
            while len(table) > keep:
                block_id = table.pop()
                if block_id != RELEASED:
                    self._drop(block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1

    def _drop(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise CacheError(f"block {block_id} freed more often than it was taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[block_id] = None
