"""Prompt log-probabilities (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`).

What lm-evaluation-harness scores a multiple-choice task with: the log-probability the model
gives each prompt token after the tokens before it. The model computes them anyway while it
reads the prompt; the runner only keeps more rows of logits: for a request that asks, every
row of its prompt chunks instead of the last (kvlab.engine.runner). Row p predicts token
p + 1, so the first prompt token has none (None, as in vLLM).

A request that asks reads its whole prompt itself: blocks from the prefix cache would skip
the rows it needs (vLLM's scheduler skips the cache for such requests too); its own blocks
still enter the cache for others. Preempted and recomputed, it rewrites the same entries.
"""

from __future__ import annotations

import torch

from kvlab.engine.sampling import Sampled


def wants_prompt_rows(seq) -> bool:
    """Whether this step's rows of `seq` still predict prompt tokens it wants the log-probabilities of."""
    return seq.params.prompt_logprobs is not None and seq.num_computed < len(seq.prompt_ids) - 1


def record_prompt_logprobs(seq, logits: torch.Tensor, start: int) -> None:
    """Row j of logits [n, V] was computed at position start + j: store the log-probability (and rank,
    and the top-N the request asked for) of the prompt token at start + j + 1."""
    prompt = seq.prompt_ids
    if len(seq.prompt_logprobs) != len(prompt):
        seq.prompt_logprobs = [None] * len(prompt)
    last = min(logits.shape[0], len(prompt) - 1 - start)  # rows past the prompt predict outputs
    if last <= 0:
        return
    logp = torch.log_softmax(logits[:last].float(), dim=-1)
    targets = torch.tensor(prompt[start + 1:start + 1 + last], dtype=torch.long)
    chosen = logp.gather(1, targets[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(dim=1) + 1
    top_n = seq.params.prompt_logprobs
    top = torch.topk(logp, top_n, dim=-1) if top_n else None
    for j in range(last):
        entry = Sampled(int(targets[j]), float(chosen[j]), rank=int(ranks[j]))
        if top is not None:
            entry.top_logprobs = list(zip(top.indices[j].tolist(), top.values[j].tolist()))
        seq.prompt_logprobs[start + 1 + j] = entry
