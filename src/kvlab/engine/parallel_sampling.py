"""`n`: independent samples of one prompt, as n sequences that share the prompt's blocks.

vLLM (V1) fans a request with n > 1 out into n child requests (ids "{i}_{parent}", seeds
seed + i when a seed is given) and lets prefix caching share the prompt. Here too, with one
difference: children admitted in the same step as the first would each compute the prompt
(a block enters the prefix cache only once it has been computed), so the siblings wait
outside the scheduler until the first child's prompt is in its blocks, and are then queued at
the front. They find every full prompt block in the cache and compute only the last partial
block, which holds the token whose logits each samples from.
"""

from __future__ import annotations

import dataclasses

from kvlab.engine.sampling import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th sample's params: n = 1, seed + i; prompt log-probabilities only once (the first)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None,
                               stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))


def child_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


class HeldSiblings:
    """Siblings waiting for their first sample's prompt to be computed."""

    def __init__(self) -> None:
        self.groups: list[tuple[object, list]] = []  # (first, its siblings)

    def hold(self, first, siblings: list) -> None:
        self.groups.append((first, list(siblings)))

    def __len__(self) -> int:
        return sum(1 for _, sibs in self.groups for s in sibs if not s.finished)

    def release(self, scheduler) -> None:
        """Queue, at the front, the siblings whose first has computed its prompt (or left)."""
        keep = []
        for first, siblings in self.groups:
            if first.finished or first.num_computed >= len(first.prompt_ids):
                for seq in reversed(siblings):
                    if not seq.finished:  # aborted while held
                        scheduler.waiting.appendleft(seq)
            else:
                keep.append((first, siblings))
        self.groups = keep
