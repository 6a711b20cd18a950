"""The JSON of a choice's log-probabilities and a response's usage, in OpenAI's and vLLM's shapes.

Completions (OpenAI's legacy shape): parallel lists `tokens`, `token_logprobs`, `top_logprobs`
(each a dict of the chosen token and the N likeliest, so up to N + 1 entries, as OpenAI and
vLLM return) and `text_offset`; an echoed prompt's first token has None for both, having no
context. Chat: `content`, one entry per token with its `top_logprobs` list. vLLM's
`prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}.
"""

from __future__ import annotations

from typing import Optional, Sequence

from kvlab.engine.sampling import Sampled

FLOOR = -9999.0  # what OpenAI and vLLM send for -inf (a token the grammar masked): JSON has no infinity


def _lp(value: float) -> float:
    return max(value, FLOOR)


class Pieces:
    """Token ids to their text, one decode per id (a response repeats the same few ids)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)
            self.cache[token_id] = text
        return text


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[Optional[Sampled]], piece: Pieces,
                        offset: int = 0) -> Optional[dict]:
    """OpenAI's completion logprobs for `token_ids` (an echoed prompt, then the output), entries aligned."""
    if not token_ids:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = piece(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_lp(entry.logprob))
        best = {text: _lp(entry.logprob)}
        for t, lp in entry.top_logprobs or []:
            best.setdefault(piece(t), _lp(lp))
        top.append(best)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries: Sequence[Sampled], piece: Pieces) -> Optional[dict]:
    if not entries:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = piece(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(s.token_id, s.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in (s.top_logprobs or [])]} for s in entries]}


def prompt_logprobs(entries: Sequence[Optional[Sampled]], piece: Pieces) -> list[Optional[dict]]:
    """vLLM's `prompt_logprobs` field: the prompt token's entry (with its rank) and the top-N (ranks 1..N)."""
    out: list[Optional[dict]] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        row = {str(entry.token_id): {"logprob": _lp(entry.logprob), "rank": entry.rank,
                                     "decoded_token": piece(entry.token_id)}}
        for rank, (t, lp) in enumerate(entry.top_logprobs or [], start=1):
            row.setdefault(str(t), {"logprob": _lp(lp), "rank": rank, "decoded_token": piece(t)})
        out.append(row)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
