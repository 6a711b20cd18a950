"""Which half of a KVQuant cache's perplexity cost is its keys' and which its values', and what
any calibration of the format could reach at best.

The real-models table gives KVQuant-3 one figure. To know where to spend bits, this study runs
the table's perplexity task (same text, windows, chunking and calibration) four times: the fp16
cache, the KVQuant cache, and the KVQuant cache with its keys or its values read back exactly
(`with_exact`: the cache still stores and rounds both halves; one of them is then replaced on
read by the values it was given).

Then it asks whether a better calibration could close the gap: it calibrates on the evaluated
windows themselves (the codebooks, key ranges and Fisher weights of exactly the tokens scored,
`oracle_calibration`) and runs the same three KVQuant rows with that. No calibration text
matches the evaluated text better than the text itself, so those rows show what the format
(its bits, its 1% of outliers, its per-layer codebooks) costs on this model once a mismatched
calibration is taken out of the question (the fit minimises a weighted squared error, not the
loss, so this is the best calibration's cost in that sense, not a proof of a floor).

It also counts, on two of the report's 2,048-token passkey prompts, how many key values fall
outside the calibrated channel ranges and how many the outlier pool keeps (`passkey_key_outliers`):
the ranges are the calibration text's, and a prompt unlike it overflows the pool.
Writes reports/real-models/kvquant_split.json:

    flock /tmp/kvlab-heavy.lock kvlab bench kvquant-split
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from kvlab.files import write_json

EXACT = ("keys", "values")


def with_exact(cache, half: str):
    """`cache` (a grow-as-you-go cache: kvlab.cache.rows.GrowingKV) with `half` ("keys" or "values")
    read back as stored, unrounded; the other half as the cache's own format returns it."""
    if half not in EXACT:
        raise ValueError(f"half must be one of {EXACT}, got {half!r}")
    given: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    store, load = cache._store, cache._load

    def _store(layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old = given.get(layer)
        given[layer] = (k.clone(), v.clone()) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
        store(layer, start, k, v)

    def _load(layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = load(layer, end)
        exact_k, exact_v = given[layer]
        return (exact_k.to(k.dtype), v) if half == "keys" else (k, exact_v.to(v.dtype))

    cache._store, cache._load = _store, _load  # instance attributes: this cache only
    cache.given = given  # what it was given, per layer: for `key_outliers`
    return cache


def key_outliers(caches: list, positions: Optional[list[int]] = None) -> dict:
    """Over KVQuant caches wrapped by `with_exact`: how many key values (past the fp16 sink tokens, or at
    the token `positions` given) fell outside their channel's calibrated range, and how many of them
    the outlier pools kept exact."""
    values = outside = kept = 0
    for cache in caches:
        for layer, rows in enumerate(cache.k_rows):
            keys, counts = cache.given[layer][0][:, :, cache.sink_tokens:], rows.counts.long()
            if positions is not None:
                index = torch.tensor([p - cache.sink_tokens for p in positions if p >= cache.sink_tokens])
                keys, counts = keys[:, :, index], counts[:, :, index]
            values += keys.numel()
            outside += int((rows.normalise(keys).abs() > 1).sum())
            kept += int(counts.sum())
    return {"key_values": values, "outside_range": outside, "kept_exact": kept}


def passkey_key_outliers(model, tokenizer, calibration, dtype: str, length: int, depth: float, seed: int = 0) -> dict:
    """`key_outliers` on one passkey prompt (the real-models report's first trial of the cell, fed in one
    pass): over all its tokens, and over the tokens that spell the key."""
    from kvlab.evals.passkey import build_prompt, trial_key
    from kvlab.evals.setting import KVSetting, new_cache

    key = trial_key(seed, length, depth, 0)
    prompt = build_prompt(tokenizer, length, depth, key)
    ids = prompt.prefix + prompt.suffix
    digits = [i for i, token in enumerate(ids) if any(c.isdigit() for c in tokenizer.decode([token]))]
    cache = with_exact(new_cache(model, KVSetting(dtype), len(ids), calibration), "keys")
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache)
    return {"length": len(ids), "depth": depth, "key": key, "all_tokens": key_outliers([cache]),
            "key_tokens": key_outliers([cache], digits)}


def oracle_calibration(model, windows: list[list[int]], meta: dict):
    """KVQuant's calibration fitted on the evaluated `windows` themselves (equal lengths): each window
    is fed as the perplexity task feeds it, so ranges, codebooks and Fisher weights are those of the
    very tokens scored."""
    from kvlab.evals.calibrate import calibrate
    context = len(windows[0])
    if any(len(window) != context for window in windows):
        raise ValueError("oracle_calibration needs windows of one length")
    return calibrate(model, [i for window in windows for i in window], context=context, windows=len(windows),
                     meta={**meta, "data": "the evaluated windows (oracle)"})


def split_rows(model, windows: list[list[int]], calibration, dtype: str, fp16_perplexity: float,
               label_suffix: str = "") -> tuple[dict, dict]:
    """The KVQuant cache's perplexity whole and with each half exact, and its key-outlier counts."""
    from kvlab.evals.perplexity import perplexity
    from kvlab.evals.setting import KVSetting, new_cache
    from kvlab.bench.real_models_study import CHUNK

    quant = KVSetting(dtype)
    runs = {"": lambda n: new_cache(model, quant, n, calibration),
            **{f", exact {half}": (lambda n, h=half: with_exact(new_cache(model, quant, n, calibration), h))
               for half in EXACT}}
    rows, made = {}, {}
    for suffix, make in runs.items():
        label = dtype + label_suffix + suffix
        made[suffix] = []
        keep = lambda n, make=make, into=made[suffix]: into.append(make(n)) or into[-1]  # noqa: E731
        rows[label] = perplexity(model, windows, keep, CHUNK)
        change = rows[label]["perplexity"] / fp16_perplexity - 1
        print(f"{label:>44}: perplexity {rows[label]['perplexity']:.3f} ({change:+.2%} vs fp16)", file=sys.stderr)
    pool = key_outliers(made[", exact keys"])
    print(f"key values outside their channel's range: {pool['outside_range'] / pool['key_values']:.2%}, kept exact: "
          f"{pool['kept_exact'] / pool['key_values']:.2%} of all", file=sys.stderr)
    return rows, pool


def run_command(args: argparse.Namespace) -> int:
    """`kvlab bench kvquant-split`: the split, the oracle calibration's bound and the passkey counts, to --out."""
    from kvlab.bench.provenance import provenance
    from kvlab.cache.kvquant_calibration import load_calibration
    from kvlab.checkpoints.resolve import load_model
    from kvlab.evals.perplexity import perplexity, text_windows
    from kvlab.evals.setting import KVSetting, build_model, new_cache
    from kvlab.bench import real_models as report
    from kvlab.bench.real_models_study import CHUNK, CONTEXT, EVAL_TEXT, OFFSET, WINDOWS

    out = args.out or report.OUT / "kvquant_split.json"
    torch.set_num_threads(args.threads)
    loaded = load_model(report.MODEL, torch.float32, "dense")
    model = build_model(loaded, KVSetting())
    calibration = load_calibration(report.OUT / report.SMOLLM2.calibration, model.config)
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(report.shared_file("data", "english", EVAL_TEXT).read_text(encoding="utf-8"), add_bos=False)
    windows = text_windows(ids[OFFSET:], CONTEXT, WINDOWS, tokenizer.bos_id if tokenizer.add_bos else None)
    rows = {"fp16": perplexity(model, windows, lambda n: new_cache(model, KVSetting("fp16"), n), CHUNK)}
    fp16 = rows["fp16"]["perplexity"]
    print(f"{'fp16':>44}: perplexity {fp16:.3f}", file=sys.stderr)
    calibrated, pool = split_rows(model, windows, calibration, args.kv_cache_dtype, fp16)
    passkey = [passkey_key_outliers(model, tokenizer, calibration, args.kv_cache_dtype, 2048, depth)
               for depth in (0.1, 0.5)]
    for cell in passkey:
        every, key = cell["all_tokens"], cell["key_tokens"]
        print(f"passkey prompt, {cell['length']} tokens, depth {cell['depth']}: key values outside their channel's "
              f"range {every['outside_range'] / every['key_values']:.2%} (the key's tokens "
              f"{key['outside_range'] / key['key_values']:.2%}), kept exact {every['kept_exact'] / every['key_values']:.2%}"
              f" ({key['kept_exact'] / key['key_values']:.2%})", file=sys.stderr)
    oracle = oracle_calibration(model, windows, {"model": report.MODEL})
    bound, oracle_pool = split_rows(model, windows, oracle, args.kv_cache_dtype, fp16,
                                    ", calibrated on the evaluated text")
    doc = {"model": report.MODEL, "text": EVAL_TEXT, "context": CONTEXT, "windows": WINDOWS, "chunk": CHUNK,
           "offset": OFFSET, "calibration": report.SMOLLM2.calibration, "rows": {**rows, **calibrated, **bound},
           "key_outliers": pool, "key_outliers_oracle": oracle_pool, "passkey_key_outliers": passkey,
           "provenance": provenance(args.threads)}
    write_json(out, doc, indent=1)
    print(f"wrote {out}")
    return 0
