"""Requests as plain state objects: a sequence's tokens, blocks, progress and timestamps.

A sequence is WAITING until the scheduler admits it, RUNNING while it holds blocks, back to
WAITING (preempted, its blocks freed, to be recomputed) when the pool runs dry, and FINISHED
with a reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or the
model length) or "abort" (the client left, or an error).

`num_computed` counts the tokens whose K/V are in the pool. Each step feeds
all_ids[num_computed : num_computed + n]; when that reaches the last token, the step's logits
for it are sampled and one token is appended. Recompute after preemption just resets
`num_computed` to 0: prompt and output so far are prefilled again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import torch

from kvlab.engine.sampling import Sampled, SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV group (kvlab.cache.kv_groups)
    seat: Optional[int] = None  # a place among max_num_seqs while running (a KIVI pool's residual rows)
    num_computed: int = 0
    draft_computed: int = 0  # tokens whose K/V a separate draft model holds (speculative decoding)
    draft_features: Optional[tuple] = None  # (first position, [n, dim]): an EAGLE head's window of target hidden states
    draft_inputs: Optional[tuple] = None  # the EAGLE head's per-position inputs for that window (EagleProposer.inputs)
    num_cached_prompt: int = 0  # prompt tokens whose blocks came from the prefix cache (last admission)
    preemptions: int = 0
    first_scheduled: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list[Sampled] = field(default_factory=list)
    prompt_logprobs: list[Optional[Sampled]] = field(default_factory=list)  # per prompt token, when asked
    generator: Optional[torch.Generator] = None
    error: Optional[str] = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def block_table(self) -> list[int]:
        """The first KV group's table: every block of a model whose layers form one group."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next sample (1 while decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
