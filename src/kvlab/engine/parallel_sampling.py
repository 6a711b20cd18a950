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

from kvlab.engine.errors import RequestError
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.sequence import Sequence


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


def add_samples(engine, prompt, params: SamplingParams, request_id: str, now=None) -> list[Sequence]:
    """LLMEngine.add_samples: the first sample is a request like any other; the siblings are checked
    and registered (so they can be aborted, and count as waiting) but held until its prompt is computed."""
    first = engine.add_request(prompt, child_params(params, 0), child_id(request_id, 0), now)
    siblings: list[Sequence] = []
    try:
        for i in range(1, params.n):
            sib_params, sib_id = child_params(params, i), child_id(request_id, i)
            if sib_id in engine.requests:
                raise RequestError(f"request id {sib_id!r} is already running", "request_id")
            if sib_params.max_tokens is None:
                sib_params.max_tokens = first.params.max_tokens
            seq = Sequence(sib_id, list(first.prompt_ids), sib_params, first.arrival)
            engine.scheduler.check_fits(seq)
            engine.logits_processor.start(sib_id, sib_params)
            engine.requests[sib_id] = (seq, engine._new_detokenizer(seq))
            engine.prompt_tokens_total += len(seq.prompt_ids)
            siblings.append(seq)
    except Exception:
        for seq in [first] + siblings:
            engine.abort(seq.request_id)
        raise
    engine.held.hold(first, siblings)
    return [first] + siblings
