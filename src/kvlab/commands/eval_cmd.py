"""`kvlab eval`: perplexity and passkey retrieval of a real model under one KV setting.

Each finished cell goes to the --out JSON at once (with the provenance of the run that made
it), so re-running the same command skips what is done: a long sweep can be run in pieces.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.commands.args import add_model_flags, non_negative_int, positive_int, positive_int_list
from kvlab.plan.kv_formats import KV_CACHE_DTYPES

TASKS = ("perplexity", "passkey")
EXAMPLES = """examples:
  kvlab eval smollm2-135m --task perplexity --kv-cache-dtype int4 --out eval.json
  kvlab eval smollm2-135m --task passkey --kv-cache-dtype kivi2 --lengths 512,2048 --trials 10 --out eval.json
  kvlab eval smollm2-135m --task perplexity,passkey --kv-heads 1 --method first --out eval.json
  kvlab eval smollm2-135m --task passkey --kv-window 256 --sink-tokens 4 --lengths 2048 --depths 0.1
  kvlab eval smollm2-135m --task perplexity --kv-cache-dtype kvquant3   # after kvlab calibrate-kv
  kvlab eval smollm2-135m --task perplexity --weights gguf-a8 --out a8.json   # the weights' own cost

Perplexity is computed through the cache, --chunk tokens at a time, on --text (default: Mary
Shelley's Frankenstein from the shared folder's data/english; a well-known novel may be partly
memorised by the model, so read the figures as comparisons between settings, not absolutes).
"""


def fraction_list(text: str) -> list[float]:
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated depths in [0, 1], got {text!r}")
    return values


def task_list(text: str) -> list[str]:
    tasks = [item.strip() for item in text.split(",") if item.strip()]
    if not tasks or any(task not in TASKS for task in tasks):
        raise argparse.ArgumentTypeError(f"expected tasks from {', '.join(TASKS)}, got {text!r}")
    return tasks


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV setting's flags (shared with the real-models report)."""
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV cache storage (auto = the activations' dtype)")
    parser.add_argument("--pre-rope-keys", action="store_true",
                        help="cache keys before RoPE (KVQuant's per-channel keys; kvquant* always does)")
    parser.add_argument("--kv-heads", type=positive_int, help="convert to this many KV heads in memory first")
    parser.add_argument("--method", default="mean", choices=("mean", "first", "random"),
                        help="how --kv-heads builds the new heads (default mean)")
    parser.add_argument("--kv-window", type=positive_int,
                        help="keep only the newest W tokens of the cache (StreamingLLM policy)")
    parser.add_argument("--sink-tokens", type=non_negative_int, default=0,
                        help="with --kv-window: also keep the first S tokens (attention sinks)")
    parser.add_argument("--kv-calibration", type=Path,
                        help="kvquant's calibration (default: the one kvlab calibrate-kv wrote beside the model)")


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text, epilog=EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="smollm2-135m, stories260k, a .gguf file or a Hugging Face model directory")
    parser.add_argument("--task", type=task_list, default=["perplexity"], help="perplexity, passkey, or both")
    add_setting_arguments(parser)
    add_model_flags(parser, weights=("dense", "gguf", "gguf-a8"), weights_default="dense", dtype=False)
    parser.add_argument("--text", type=Path, help="perplexity text (default: data/english/frankenstein.txt)")
    parser.add_argument("--context", type=positive_int, default=1024, help="tokens per perplexity window (1024)")
    parser.add_argument("--windows", type=positive_int, default=1, help="perplexity windows, consecutive (1)")
    parser.add_argument("--offset", type=non_negative_int, default=1000,
                        help="text tokens skipped first (default 1000: past the title page and contents)")
    parser.add_argument("--chunk", type=positive_int, default=128,
                        help="tokens fed through the cache at a time (default 128)")
    parser.add_argument("--lengths", type=positive_int_list, default=[512, 1024, 2048],
                        help="passkey prompt lengths in tokens (default 512,1024,2048)")
    parser.add_argument("--depths", type=fraction_list, default=[0.1, 0.5, 0.9],
                        help="where the key sits, as a fraction of the filler (default 0.1,0.5,0.9)")
    parser.add_argument("--trials", type=positive_int, default=10, help="passkey keys per (length, depth) (10)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the passkey keys and conversions")
    parser.add_argument("--out", type=Path, help="results JSON, created or resumed (finished cells are skipped)")
    parser.add_argument("--json", action="store_true", help="print the finished cells as one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def setting_from_args(args: argparse.Namespace):
    from kvlab.evals.setting import KVSetting

    return KVSetting(args.kv_cache_dtype, args.pre_rope_keys, args.kv_heads, args.method, args.kv_window,
                     args.sink_tokens)


def default_text() -> Path:
    from kvlab.checkpoints.resolve import shared_dirs
    from kvlab.evals.setting import EvalError

    for directory in shared_dirs():
        path = directory / "data" / "english" / "frankenstein.txt"
        if path.is_file():
            return path
    raise EvalError("no data/english/frankenstein.txt in the shared folder; give --text FILE or set KVLAB_SHARED")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvlab.bench.provenance import provenance
    from kvlab.checkpoints.resolve import load_model
    from kvlab.evals.calibration_io import calibration_loader
    from kvlab.evals.runner import Evaluator, PasskeyTask, PerplexityTask
    from kvlab.evals.setting import EvalError
    from kvlab.evals.store import ResultStore

    if args.threads:
        torch.set_num_threads(args.threads)
    setting = setting_from_args(args)
    text = args.text or default_text() if "perplexity" in args.task else None
    if args.weights != "dense" and args.kv_heads:
        raise EvalError("--kv-heads averages weights into new heads, which needs --weights dense")
    loaded = load_model(args.model, torch.float32, args.weights)
    store = ResultStore(args.out, {"model": args.model, "weights": args.weights})
    store.add_run({**provenance(args.threads), "seed": args.seed})
    evaluator = Evaluator(loaded, store, calibration_loader(loaded.path, args.kv_calibration))
    tasks = []
    if "perplexity" in args.task:
        tasks.append(PerplexityTask(text, args.context, args.windows, args.chunk, args.offset))
    if "passkey" in args.task:
        tasks.append(PasskeyTask(tuple(args.lengths), tuple(args.depths), args.trials, args.seed, args.chunk))
    total = sum(evaluator.pending(setting, task) for task in tasks)
    bar = None
    if total and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=f"eval {setting.label}", unit="window/trial", file=sys.stderr,
                   dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 30.0)
        evaluator.on_progress = bar.update
    cells = []
    try:
        for task in tasks:
            if isinstance(task, PerplexityTask):
                cells.append(evaluator.perplexity(setting, task))
            else:
                cells.extend(evaluator.passkey(setting, task))
    finally:
        if bar is not None:
            bar.close()
    store.save()
    if args.json:
        print(json.dumps({"model": args.model, "setting": setting.as_dict(), "cells": cells}, indent=1))
        return 0
    for cell in cells:
        if cell["task"] == "perplexity":
            print(f"{setting.label}: perplexity {cell['perplexity']:.3f} over {cell['tokens_scored']:,} tokens of "
                  f"{cell['text']} (context {cell['context']}, chunk {cell['chunk']})")
        else:
            print(f"{setting.label}: passkey length {cell['prompt_tokens']:>5} depth {cell['depth']:.2f}: "
                  f"{cell['correct']}/{cell['trials']} correct")
    return 0
