"""The data every built-in draft head trains on, in one place: the target's own hidden states and
greedy choices over a set of sequences (cached once, whatever head kind reads them), and the
reduced draft vocabulary chosen from those choices (FR-Spec, arXiv 2502.14856).

A record is {"ids" int32 [T], "hidden" fp16 [T, dim] (the final hidden state after the final norm,
what the LM head reads), "choice" int32 [T] (the target's argmax at each position: its choice for
the next token)}, plus "answer_from" where the command knows where the answer starts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvlab.train.loop import save_atomic

FEATURES_FORMAT = "kvlab-eagle-features-1"  # the name the first (EAGLE) caches were written with


@torch.inference_mode()
def collect_features(model, sequences: list[list[int]], progress: bool = True) -> list[dict]:
    """Each sequence through the target: {"ids", "hidden" fp16 [T, dim], "choice" int32 [T]}."""
    from kvlab.train.progress import progress_bar
    bar = progress_bar(len(sequences), "target hidden states", unit="seq", enabled=progress)
    out = []
    for ids in sequences:
        tokens = torch.tensor([ids])
        logits, hidden = model(tokens, with_hidden=True)
        out.append({"ids": tokens[0].to(torch.int32), "hidden": hidden[0].to(torch.float16),
                    "choice": logits[0].argmax(-1).to(torch.int32)})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out


def load_or_collect(path: Path, model, sequences: list[list[int]], key: str, progress: bool = True) -> list[dict]:
    if path.exists():
        cached = torch.load(path, map_location="cpu", weights_only=False)
        if cached.get("format") == FEATURES_FORMAT and cached.get("key") == key:
            return cached["records"]
    records = collect_features(model, sequences, progress)
    save_atomic({"format": FEATURES_FORMAT, "key": key, "records": records}, path)
    return records


def draft_vocabulary(records: list[dict], size: int, vocab: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent greedy choices (sorted by frequency) and the share of positions they cover."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for r in records:
        counts += torch.bincount(r["choice"].long(), minlength=vocab)
    size = min(size, vocab)
    top = counts.topk(size)
    return top.indices, float(top.values.sum()) / max(1, int(counts.sum()))


__all__ = ["FEATURES_FORMAT", "collect_features", "load_or_collect", "draft_vocabulary"]
