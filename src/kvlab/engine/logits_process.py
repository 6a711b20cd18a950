"""What a request changes in its logits before the sampler draws: grammar masks, logit_bias,
min_tokens, and presence / frequency / repetition penalties, in vLLM's order.

vLLM masks with the grammar first (its model runner applies the bitmask before the sampler),
and its sampler keeps those logits for log-probabilities; then it adds logit_bias, masks EOS
and stop_token_ids until min_tokens are out, and applies the penalties (repetition, then
frequency and presence) before temperature, top_k, top_p and min_p (kvlab.engine.sampling).
The same order here, on the rows of one step's logits [rows, vocab] whose request asks for any
of it: a plain request's row is never copied or touched, and a step with no such row costs
one pass over the step's params.

The penalties' definitions are vLLM's (OpenAI's for presence and frequency): frequency counts a
token's occurrences in the output so far, presence whether it occurred; repetition (CTRL,
Keskar et al. 2019) divides a positive logit by the penalty and multiplies a negative one, for
every token in the prompt or the output.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvlab.engine.structured import Grammars, Tracked, mask_rows


class LogitsProcessor:
    """Per engine: the grammar side and the constrained requests' matchers, keyed by request id."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_id = tokenizer.eos_id if tokenizer is not None else None
        self.grammars = Grammars(tokenizer, vocab_size)
        self.tracked: dict[str, Tracked] = {}

    def check(self, params) -> None:
        """Refuse at admission what the processor cannot apply: biases of tokens outside the vocabulary,
        an invalid grammar (compiled here, so the 400 comes before any step)."""
        from kvlab.engine.errors import RequestError

        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                                   "logit_bias")
        if params.structured_outputs is not None:
            self.grammars.grammar(params.structured_outputs)

    def start(self, request_id: str, params) -> None:
        """A constrained request's matcher, made when it is added (RequestError if its grammar is invalid)."""
        if params.structured_outputs is not None:
            self.tracked[request_id] = Tracked(self.grammars.matcher(params.structured_outputs))

    def forget(self, seq) -> None:
        """A request left (finished, aborted, failed): drop its matcher."""
        self.tracked.pop(seq.request_id, None)

    def apply(self, logits: torch.Tensor, seqs: Sequence) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(logits to sample from, logits for log-probabilities or None when those are the same) for one
        step's sampled rows [rows, vocab], row i belonging to seqs[i]. `logits` is the caller's own (the runner's
        gathered rows, or the step's scores themselves where every row is sampled): it is changed in place."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.processed]
        if not rows:
            return logits, None
        logits = logits.float()
        constrained = [i for i in rows if seqs[i].request_id in self.tracked]
        if constrained:
            tracked = [self.tracked[seqs[i].request_id] for i in constrained]
            for i, t in zip(constrained, tracked):
                t.catch_up(seqs[i].output_ids)
            mask_rows(logits, constrained, tracked)
        raw = logits
        biased = [i for i in rows if _changes_after_mask(seqs[i].params)]
        if biased:
            raw = logits.clone()
            for i in biased:
                self._bias_and_penalise(logits[i], seqs[i])
        return logits, (raw if raw is not logits else None)

    def _bias_and_penalise(self, row: torch.Tensor, seq) -> None:
        """logit_bias, min_tokens and the penalties on one row [V], in place."""
        p = seq.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype))
        if p.min_tokens and len(seq.output_ids) < p.min_tokens:
            stops = [t for t in p.stop_token_ids if t < self.vocab_size]
            if self.eos_id is not None and not p.ignore_eos:
                stops.append(self.eos_id)
            if stops:
                kept = row.clone()
                row[stops] = float("-inf")
                if not torch.isfinite(row).any():  # the grammar allows nothing but EOS: it wins over min_tokens
                    row.copy_(kept)
        if p.penalized:
            penalise(row, seq.prompt_ids, seq.output_ids, p.presence_penalty, p.frequency_penalty,
                     p.repetition_penalty)


def _changes_after_mask(params) -> bool:
    return params.penalized or bool(params.logit_bias) or params.min_tokens > 0


def penalise(row: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int], presence: float,
             frequency: float, repetition: float) -> None:
    """vLLM's penalties on one row of logits [V], in place: repetition over prompt and output tokens,
    then frequency (times each output token's count) and presence (once per output token seen)."""
    vocab = row.shape[0]
    if repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long)] = True
        scaled = torch.where(row > 0, row / repetition, row * repetition)
        row.copy_(torch.where(seen, scaled, row))
    if (frequency or presence) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        row -= frequency * counts.to(row.dtype) + presence * (counts > 0).to(row.dtype)
