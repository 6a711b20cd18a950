"""The per-step batch description a serving step hands down to attention: vLLM's attention metadata.

A serving step runs several sequences at once, each at its own position: one decodes its
1,000th token while another reads the third chunk of its prompt. Nothing about positions
lives in the model or the cache; the engine's runner fills one `StepBatch` per step and the
model, attention and the pool read it:

- the step's new tokens are packed into one row, sequence after sequence (`query_lens` each);
- `positions[i]` is the position of packed token i in its own sequence (RoPE reads it);
- `slot_mapping[i]` is where its K/V go in the pool: block id x block_size + offset;
- `context_lens[s]` is how many tokens sequence s attends over after this step's writes;
- `block_tables[s]` lists sequence s's blocks in order, enough for `context_lens[s]` tokens;
  under a sinks + window policy (`kv_window`, `sink_tokens`) a block no query will read again
  has been handed back and its entry is `RELEASED`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from kvlab.cache.base import CacheError

RELEASED = -1  # a block table entry whose block was handed back (out of every future query's window)


@dataclass
class StepBatch:
    """What one forward pass over several sequences needs to know about them (see module doc)."""

    query_lens: list[int]
    context_lens: list[int]
    positions: Tensor  # [N] long
    slot_mapping: Tensor  # [N] long
    block_tables: list[list[int]]
    block_size: int
    kv_window: Optional[int] = None  # StreamingLLM's policy: a query at t sees p < sink_tokens or p >= t - kv_window
    sink_tokens: int = 0

    @classmethod
    def build(cls, starts: Sequence[int], query_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, kv_window: Optional[int] = None, sink_tokens: int = 0) -> "StepBatch":
        """Sequence s feeds `query_lens[s]` tokens at positions starts[s].. and keeps its K/V in `block_tables[s]`."""
        if not (len(starts) == len(query_lens) == len(block_tables)) or not starts:
            raise CacheError("a step needs one start, query length and block table per sequence, and at least one")
        positions, slots = [], []
        for start, length, table in zip(starts, query_lens, block_tables):
            if start < 0 or length <= 0:
                raise CacheError(f"a sequence must start at a position >= 0 and feed >= 1 token, got {start}, {length}")
            end = start + length
            if len(table) * block_size < end:
                raise CacheError(f"a block table of {len(table)} blocks of {block_size} cannot hold {end} tokens")
            for p in range(start, end):
                if table[p // block_size] == RELEASED:
                    raise CacheError(f"position {p} falls in a released block")
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
        return cls(list(query_lens), [s + n for s, n in zip(starts, query_lens)],
                   torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
                   [list(t) for t in block_tables], block_size, kv_window, sink_tokens)

    def window_mask(self, new: int, context: int, held: Tensor) -> Tensor:
        """[new, held] mask of one sequence's queries (the last `new` of `context`) over the positions
        `held` its blocks still hold, under the sinks + window policy."""
        queries = torch.arange(context - new, context)[:, None]
        held = held[None, :]
        return (held <= queries) & ((held < self.sink_tokens) | (held >= queries - self.kv_window))

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one token (what the fused C step runs)."""
        return all(n == 1 for n in self.query_lens)

    def last_token_index(self) -> Tensor:
        """Index in the packed row of each sequence's last new token (whose logits are sampled)."""
        return torch.tensor(self.query_lens).cumsum(0) - 1
