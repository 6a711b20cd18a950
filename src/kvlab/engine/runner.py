"""One forward pass for a scheduled step: build the batch description, run the model, sample.

The module-by-module path (kvlab.nn.Decoder with a kvlab.cache.StepBatch) serves every model
and step; it is the reference the C paged step is tested against. Only the sequences whose
step reaches their last token are sampled: a prompt chunk in the middle produces nothing.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.engine.sampling import Sampled, sample_rows
from kvlab.engine.scheduler import ScheduledStep

PagedStep = Callable[[torch.Tensor, StepBatch], torch.Tensor]  # (ids [S], decode batch) -> logits [S, V]


class ModelRunner:
    def __init__(self, model, pool: KVPool, seed: int = 0, paged_step: Optional[PagedStep] = None) -> None:
        self.model, self.pool = model, pool
        self.generator = torch.Generator().manual_seed(seed)
        self.paged_step = paged_step  # a fused decode step over the pool, where one applies

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> list[Optional[Sampled]]:
        """Feed each sequence its scheduled tokens; one Sampled per sequence that reached its last token."""
        starts = [seq.num_computed for seq in step.seqs]
        ids = [t for seq, n in zip(step.seqs, step.num_tokens) for t in seq.all_ids[seq.num_computed:seq.num_computed + n]]
        batch = StepBatch.build(starts, step.num_tokens, [seq.block_table for seq in step.seqs], self.pool.block_size)
        if self.paged_step is not None and batch.is_decode:
            logits = self.paged_step(torch.tensor(ids), batch)
        else:
            logits = self.model(torch.tensor([ids]), self.pool, last_only=True, step=batch)[0]
        for seq, n in zip(step.seqs, step.num_tokens):
            seq.num_computed += n
        rows = [i for i, seq in enumerate(step.seqs) if seq.num_computed == seq.num_tokens]
        drawn = sample_rows(logits[rows], [step.seqs[i].params for i in rows],
                            [step.seqs[i].generator for i in rows], self.generator) if rows else []
        out: list[Optional[Sampled]] = [None] * len(step.seqs)
        for i, sampled in zip(rows, drawn):
            out[i] = sampled
        return out
