"""Perplexity computed through the cache: each window of text is fed chunk by chunk.

Feeding the text in chunks (not one full-sequence pass) is what makes a cache setting matter:
every chunk's queries read the keys and values of earlier chunks back from the cache, so a
4-bit cache's rounding of old tokens shows up in the loss of the new ones.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from kvlab.evals.setting import EvalError


def text_windows(ids: Sequence[int], context: int, windows: int, bos: Optional[int]) -> list[list[int]]:
    """`windows` consecutive, non-overlapping windows of `context` tokens (a BOS first when the model has one)."""
    body = context - (1 if bos is not None else 0)
    if context < 2 or windows < 1:
        raise EvalError(f"perplexity needs --context >= 2 and --windows >= 1, got {context} and {windows}")
    if body * windows > len(ids):
        raise EvalError(f"the text has {len(ids):,} tokens, fewer than {windows} windows of {body:,}")
    prefix = [bos] if bos is not None else []
    return [prefix + list(ids[i * body:(i + 1) * body]) for i in range(windows)]


@torch.no_grad()
def window_nll(model, window: Sequence[int], cache, chunk: int) -> tuple[float, int]:
    """Summed negative log-likelihood of tokens 1..T-1 of `window` given the previous ones, and their count."""
    if chunk < 1:
        raise EvalError(f"--chunk must be positive, got {chunk}")
    ids = torch.tensor([list(window)], dtype=torch.long)
    total, count = 0.0, 0
    for start in range(0, ids.shape[1] - 1, chunk):
        piece = ids[:, start:min(start + chunk, ids.shape[1] - 1)]
        targets = ids[:, start + 1:start + 1 + piece.shape[1]]
        logits = model(piece, cache=cache).float()
        total += float(F.cross_entropy(logits[0], targets[0], reduction="sum"))
        count += targets.shape[1]
    return total, count


def perplexity(model, windows: list[list[int]], make_cache: Callable[[int], object], chunk: int,
               on_window: Optional[Callable[[int, float, int], None]] = None) -> dict:
    """Token-weighted perplexity over `windows`, each on a fresh cache from `make_cache(max_tokens)`."""
    nll, tokens, per_window = 0.0, 0, []
    for index, window in enumerate(windows):
        total, count = window_nll(model, window, make_cache(len(window)), chunk)
        nll, tokens = nll + total, tokens + count
        per_window.append(math.exp(total / count))
        if on_window is not None:
            on_window(index, total, count)
    return {"perplexity": math.exp(nll / tokens), "nll_per_token": nll / tokens, "tokens_scored": tokens,
            "per_window_perplexity": per_window}
