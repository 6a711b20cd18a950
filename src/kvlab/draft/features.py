"""The data every built-in draft head trains on, in one place: the target's own hidden states and
greedy choices over a set of sequences (cached once, whatever head kind reads them), and the
reduced draft vocabulary chosen from those choices (FR-Spec, arXiv 2502.14856).

A record is {"ids" int32 [T], "hidden" fp16 [T, dim] (the final hidden state after the final norm,
what the LM head reads), "choice" int32 [T] (the target's argmax at each position: its choice for
the next token)}, plus "answer_from" where the command knows where the answer starts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch

from kvlab.train.loop import save_atomic

FEATURES_FORMAT = "kvlab-eagle-features-1"  # the name the first (EAGLE) caches were written with


SAVE_EVERY_SECONDS = 60.0  # a partial cache is rewritten at most this often while collecting


@torch.inference_mode()
def collect_features(model, sequences: list[list[int]], progress: bool = True, done: Optional[list[dict]] = None,
                     max_seconds: Optional[float] = None,
                     save: Optional[Callable[[list[dict]], None]] = None) -> list[dict]:
    """Each sequence through the target: {"ids", "hidden" fp16 [T, dim], "choice" int32 [T]}, continuing
    after the records `done` holds; stops after `max_seconds` (fewer records than sequences), calling `save`
    with what it has at most every SAVE_EVERY_SECONDS and at the end."""
    from kvlab.train.progress import progress_bar
    out = list(done or [])
    bar = progress_bar(len(sequences), "target hidden states", initial=len(out), unit="seq", enabled=progress)
    started = saved = time.monotonic()
    for ids in sequences[len(out):]:
        if max_seconds is not None and time.monotonic() - started > max_seconds:
            break
        tokens = torch.tensor([ids])
        logits, hidden = model(tokens, with_hidden=True)
        out.append({"ids": tokens[0].to(torch.int32), "hidden": hidden[0].to(torch.float16),
                    "choice": logits[0].argmax(-1).to(torch.int32)})
        if bar is not None:
            bar.update(1)
        if save is not None and time.monotonic() - saved > SAVE_EVERY_SECONDS and len(out) < len(sequences):
            save(out)
            saved = time.monotonic()
    if bar is not None:
        bar.close()
    if save is not None:
        save(out)
    return out


def load_or_collect(path: Path, model, sequences: list[list[int]], key: str, progress: bool = True,
                    max_seconds: Optional[float] = None) -> Optional[list[dict]]:
    """The records of `sequences` (cached at `path` under `key`), or None when `max_seconds` ran out first:
    what was collected is kept (a partial cache, "complete": False) and the next call goes on from it."""
    done: list[dict] = []
    if path.exists():
        cached = torch.load(path, map_location="cpu", weights_only=False)
        if cached.get("format") == FEATURES_FORMAT and cached.get("key") == key:
            if cached.get("complete", True):  # caches written before partial ones existed were whole
                return cached["records"]
            done = cached["records"]

    def save(records: list[dict]) -> None:
        save_atomic({"format": FEATURES_FORMAT, "key": key, "complete": len(records) == len(sequences),
                     "records": records}, path)

    records = collect_features(model, sequences, progress, done, max_seconds, save)
    return records if len(records) == len(sequences) else None


def draft_vocabulary(records: list[dict], size: int, vocab: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent greedy choices (sorted by frequency) and the share of positions they cover."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for r in records:
        counts += torch.bincount(r["choice"].long(), minlength=vocab)
    size = min(size, vocab)
    top = counts.topk(size)
    return top.indices, float(top.values.sum()) / max(1, int(counts.sum()))


__all__ = ["FEATURES_FORMAT", "collect_features", "load_or_collect", "draft_vocabulary"]
