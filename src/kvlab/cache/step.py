"""The per-step batch description a serving step hands down to attention: vLLM's attention metadata.

A serving step runs several sequences at once, each at its own position: one decodes its
1,000th token while another reads the third chunk of its prompt. Nothing about positions
lives in the model or the cache; whoever drives the model (the engine's runner, or a lab
command feeding a batch of rows) fills one `StepBatch` per step and the model, attention and
the pool read it:

- the step's new tokens are packed into one row, sequence after sequence (`query_lens` each);
- `positions[i]` is the position of packed token i in its own sequence (RoPE reads it);
- `context_lens[s]` is how many tokens sequence s attends over after this step's writes;
- `seats[s]` is sequence s's seat (a KIVI pool keeps its residual there; by default its index);
- per KV group g (kvlab.cache.kv_groups): `group_tables[g][s]` lists sequence s's blocks in
  order, enough for `context_lens[s]` tokens (a block no query will read again may have been
  handed back: its entry is `RELEASED`), and `group_slots[g][i]` is where packed token i's
  K/V go in that group's layers: block id x block_size + offset.

`build` computes positions and slots with tensor operations, not a loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from kvlab.cache.base import CacheError
from kvlab.cache.kv_groups import RELEASED

PADDING = -2  # past a table's end: never a block


@dataclass
class StepBatch:
    """What one forward pass over several sequences needs to know about them (see module doc)."""

    query_lens: list[int]
    context_lens: list[int]
    positions: Tensor  # [N] long
    group_tables: list[list[list[int]]]  # [group][sequence] -> block ids
    group_slots: list[Tensor]  # [group] -> [N] long
    block_size: int
    seats: Optional[list[int]] = None  # each sequence's seat: where a KIVI pool keeps its residual

    @classmethod
    def build(cls, starts: Sequence[int], query_lens: Sequence[int],
              block_tables: Optional[Sequence[Sequence[int]]] = None, block_size: int = 16, *,
              group_tables: Optional[Sequence[Sequence[Sequence[int]]]] = None,
              seats: Optional[Sequence[int]] = None) -> "StepBatch":
        """Sequence s feeds `query_lens[s]` tokens at positions starts[s].. and keeps its K/V in
        group_tables[g][s] for each KV group g (`block_tables`: the tables of a pool of one group)."""
        if group_tables is None:
            if block_tables is None:
                raise CacheError("a step needs the sequences' block tables")
            group_tables = [block_tables]
        if not starts or not all(len(tables) == len(starts) == len(query_lens) for tables in group_tables):
            raise CacheError("a step needs one start, query length and block table per sequence, and at least one")
        if min(starts) < 0 or min(query_lens) <= 0:
            raise CacheError(f"a sequence must start at a position >= 0 and feed >= 1 token, got {list(starts)}, "
                             f"{list(query_lens)}")
        lens = torch.tensor(list(query_lens), dtype=torch.long)
        total = int(lens.sum())
        seq_of = torch.arange(len(lens)).repeat_interleave(lens)
        offsets = torch.arange(total) - (lens.cumsum(0) - lens).repeat_interleave(lens)
        positions = torch.tensor(list(starts), dtype=torch.long).repeat_interleave(lens) + offsets
        logical = positions // block_size
        slots = []
        for tables in group_tables:
            width = max(1, max(len(table) for table in tables))
            padded = torch.tensor([list(table) + [PADDING] * (width - len(table)) for table in tables], dtype=torch.long)
            blocks = padded[seq_of, logical.clamp(max=width - 1)]
            blocks[logical >= width] = PADDING
            if bool((blocks < 0).any()):
                bad = int((blocks < 0).nonzero()[0])
                s, p = int(seq_of[bad]), int(positions[bad])
                why = "falls in a released block" if int(blocks[bad]) == RELEASED else \
                    f"is past a block table of {len(tables[s])} blocks of {block_size}"
                raise CacheError(f"position {p} of sequence {s} {why}")
            slots.append(blocks * block_size + positions % block_size)
        return cls(list(query_lens), [s + n for s, n in zip(starts, query_lens)], positions,
                   [[list(table) for table in tables] for tables in group_tables], slots, block_size,
                   list(seats) if seats is not None else list(range(len(starts))))

    @property
    def block_tables(self) -> list[list[int]]:
        """The first group's tables (a pool of one group: every sequence's table)."""
        return self.group_tables[0]

    @property
    def slot_mapping(self) -> Tensor:
        return self.group_slots[0]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one token (what the paged C step runs)."""
        return all(n == 1 for n in self.query_lens)

    def last_token_index(self) -> Tensor:
        """Index in the packed row of each sequence's last new token (whose logits are sampled)."""
        return torch.tensor(self.query_lens).cumsum(0) - 1
