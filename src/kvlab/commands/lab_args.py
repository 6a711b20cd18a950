"""Flags shared by the commands that run a real model through the engine (`kvlab generate`, `kvlab measure`)."""

from __future__ import annotations

import argparse
import sys

from kvlab.commands.args import add_model_flags, positive_int
from kvlab.plan.kv_formats import POOL_KV_CACHE_DTYPES


def add_lab_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="smollm2-135m, stories260k, a .gguf file or a Hugging Face model directory")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=POOL_KV_CACHE_DTYPES,
                        help="KV cache storage, the engine's paged pool as `kvlab serve` runs it (auto = the "
                             "activations' dtype)")
    parser.add_argument("--kv-calibration", metavar="FILE",
                        help="kvquant3/kvquant4's codebooks and key ranges, from `kvlab calibrate-kv` (default: the "
                             "file it writes beside the model)")
    parser.add_argument("--kv-heads", type=positive_int,
                        help="convert to this many KV heads first (mean-pooled groups, or repeated heads); fewer "
                             "heads without uptraining is not a usable model: see kvlab convert and kvlab uptrain")
    add_model_flags(parser)


def load_from_args(args: argparse.Namespace):
    """The model the flags name, converted to --kv-heads when asked (a dense copy: conversion averages weights)."""
    from kvlab.cache.base import TORCH_DTYPES
    from kvlab.checkpoints.resolve import load_checkpoint, resolve_packing
    from kvlab.nn.threads import fix_threads

    packing = resolve_packing(args.weights, args.kv_heads)
    if args.threads:
        fix_threads(args.threads)
    loaded = load_checkpoint(args.model, TORCH_DTYPES[args.dtype], packing)
    if args.kv_heads and args.kv_heads != loaded.model.config.kv_heads:
        from kvlab.checkpoints.convert import convert_kv_heads
        before = loaded.model.config.kv_heads
        loaded.model = convert_kv_heads(loaded.model, args.kv_heads, "mean")  # a bad count is an error, no warning
        if args.kv_heads < before:
            print(pooled_warning(args.model, before, args.kv_heads), file=sys.stderr)
    return loaded


# What mean-pooling costs, where it was measured (reports/real-models, perplexity on Frankenstein)
MEASURED_POOLING = {("smollm2-135m", 3, 1): "perplexity 28.1 -> 15,477 on Frankenstein (reports/real-models)"}


def pooled_warning(model: str, before: int, after: int) -> str:
    """One line: a mean-pooled conversion without uptraining is a starting point, not a model."""
    name = "smollm2-135m" if model.strip().lower() in ("smollm2", "smollm2-135m") else model
    cost = MEASURED_POOLING.get((name, before, after))
    return (f"kvlab: warning: --kv-heads {after} mean-pools {before} KV heads in memory with no uptraining, which "
            f"loses most of the model{f' ({cost})' if cost else ''}; for a usable one: kvlab convert {model} "
            f"--kv-heads {after} -o DIR (aligned on calibration text), then kvlab uptrain DIR --teacher {model}")
