"""Per-sequence block tables over one pool, with ref-counts and prefix caching (nano-vllm's shape).

The pool (kvlab.cache.KVPool) only stores tensors; which blocks a sequence owns, how many
sequences share a block and which prompt prefix a block holds live here, in pure Python.
Every action has its check: `can_allocate`/`allocate` when a sequence is admitted,
`can_append`/`append` before a step grows it, `free` when it finishes, is aborted or preempted.
Under a sinks + window policy `release_outside_window` hands back, after each step, the
blocks no future query of the sequence can see; their table entries become `RELEASED`.

Prefix caching (vLLM's automatic prefix caching): a full block is named by a hash chained
from the first token, hash(previous block's hash, this block's token ids), and confirmed by
comparing the token ids themselves, so a collision can never serve the wrong K/V. A block
whose last user leaves keeps its hash and joins the back of the free queue: allocation takes
from the front, so freed blocks are reused least recently freed first, and a prefix that
arrives again before its blocks are taken is served from the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from kvlab.cache.base import CacheError
from kvlab.cache.step import RELEASED
from kvlab.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[int] = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(previous: Optional[int], token_ids: tuple[int, ...]) -> int:
    """A full block's name: its tokens and everything before them (Python's tuple hash is stable for ints)."""
    return hash((previous, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise CacheError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.by_hash: dict[int, int] = {}
        self.hash_chains: dict[int, list[int]] = {}  # request id -> hashes of its full blocks, in order
        self.prefix_queries = 0  # prompt tokens looked up in the cache (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of which found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

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

    # -- admission ---------------------------------------------------------------------------------

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks holding a prefix of `seq` (never its last token, whose logits are needed)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # a request asking for prompt log-probabilities reads every prompt row itself
        ids, previous, found = seq.all_ids, None, []
        for b in range((len(ids) - 1) // self.block_size):
            tokens = tuple(ids[b * self.block_size:(b + 1) * self.block_size])
            previous = chain_hash(previous, tokens)
            block_id = self.by_hash.get(previous)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether `seq` can be admitted with its first chunk (`reserve` more tokens than are cached)."""
        cached = self._cached_prefix(seq)
        reusable_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        tokens = len(cached) * self.block_size + reserve
        need = max(0, self.blocks_for(tokens) - len(cached))
        return need <= self.num_free - reusable_free

    def allocate(self, seq: Sequence, reserve: int = 0) -> None:
        """Give `seq` its cached prefix blocks plus fresh ones for `reserve` more tokens; sets num_computed."""
        if seq.block_table:
            raise CacheError(f"request {seq.request_id} already holds blocks")
        if not self.can_allocate(seq, reserve):
            raise CacheError(f"KV block pool exhausted admitting request {seq.request_id}")
        cached = self._cached_prefix(seq)
        for block_id in cached:
            self._take(block_id)
        seq.block_table = list(cached)
        seq.num_computed = len(cached) * self.block_size
        seq.draft_computed = 0  # a draft model recomputes its own K/V for cached blocks
        self.prefix_queries += len(seq.prompt_ids)
        self.prefix_hits += min(seq.num_computed, len(seq.prompt_ids))
        seq.num_cached_prompt = min(seq.num_computed, len(seq.prompt_ids))
        self.hash_chains[seq.request_id] = [self.blocks[b].hash for b in cached]
        self.append(seq, reserve)

    # -- growth ------------------------------------------------------------------------------------

    def missing(self, seq: Sequence, new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed + new_tokens) - len(seq.block_table))

    def can_append(self, seq: Sequence, new_tokens: int) -> bool:
        return self.missing(seq, new_tokens) <= self.num_free

    def append(self, seq: Sequence, new_tokens: int) -> None:
        """Blocks for `new_tokens` more tokens of `seq` (all or nothing)."""
        need = self.missing(seq, new_tokens)
        if need > self.num_free:
            raise CacheError(f"KV block pool exhausted: request {seq.request_id} needs {need} more blocks, "
                             f"{self.num_free} are free")
        for _ in range(need):
            block_id = next(iter(self.free_ids))
            self._forget(self.blocks[block_id])  # evict the least recently freed cached block
            self._take(block_id)
            seq.block_table.append(block_id)

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
            if seq.block_table[b] == RELEASED:  # handed back under the window policy: nothing to name
                chain.append(h)
                continue
            block = self.blocks[seq.block_table[b]]
            if block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.by_hash.setdefault(h, block.block_id)
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
        if self.by_hash.get(block.hash) == block.block_id:
            del self.by_hash[block.hash]
        block.hash, block.token_ids = None, ()
        return True

    # -- release -----------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq`; shared ones only lose a reference. Idempotent per sequence."""
        for block_id in reversed(seq.block_table):  # the tail first: it is the least likely to be shared
            if block_id == RELEASED:
                continue
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise CacheError(f"block {block_id} freed more often than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        seq.block_table = []
        seq.num_computed = seq.draft_computed = 0
        self.hash_chains.pop(seq.request_id, None)

    def release_outside_window(self, seq: Sequence, window: int, sinks: int) -> int:
        """Hand back the blocks of `seq` no future query sees: every position in them is at or past
        `sinks` and before num_computed - window (a query at t >= num_computed sees p < sinks or
        p >= t - window). Returns how many were released."""
        limit = seq.num_computed - window
        released = 0
        for b in range(-(-sinks // self.block_size), max(0, limit // self.block_size)):
            block_id = seq.block_table[b]
            if block_id == RELEASED:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None
            seq.block_table[b] = RELEASED
            released += 1
        return released

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds now (its table less the released entries)."""
        return sum(1 for block_id in seq.block_table if block_id != RELEASED)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the last valid token (a speculative step's rejected drafts)."""
        keep = self.blocks_for(seq.num_computed)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block.block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1
