"""Decode steps of MLA conversions against their GQA source, all in the C step (kvlab.nn.paged_decode).

    kvlab bench mla-decode DIR [DIR ...] [--source smollm2-135m] [--contexts 128,4096] [--rows 1,16]
                           [--kv-cache-dtype fp16] [--repeats 15] [--threads N] [--json PATH]

(its flags are kvlab.commands.bench_mla_cmd's; this module measures and writes the JSON).

Every model is loaded with `--weights q8_0`: the source GGUF dequantised and each `kvlab convert
--to mla` directory's safetensors, all rounded to Q8_0 blocks the same way, so the ratio is the
attention designs' and not two weight formats'. For each (rows, context) the models' C steps
take turns on pools of random rows (a step's time does not depend on the values; a real prefill
of 16 x 4,096 tokens would take minutes), one token per row, medians of `--repeats` steps after a
warm-up. At the shortest context each conversion's module path (how the engine served MLA before
the C step ran it) takes its turn too.

What decides the ratio: at a short context a step reads the weights (an exact conversion adds
W_uv, 1% of SmolLM2's); at a long one the cache rows. An exact conversion's row is as wide as
the source's K and V together, and absorbed attention spends more multiply-adds per row than
GQA (every query head weighs the whole latent: on SmolLM2's full-rank conversion 9 x (64 + 192)
per token against GQA's 9 x (64 + 64)), so only a conversion whose cache is smaller can be
faster there.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from kvlab.bench.paged_decode_speed import median_ms, random_pool
from kvlab.bench.provenance import provenance
from kvlab.cache.step import StepBatch
from kvlab.checkpoints.resolve import load_checkpoint
from kvlab.files import write_json
from kvlab.nn.paged_decode import PagedDecodeStep, why_not_paged
from kvlab.plan.errors import PlanError

BLOCK = 64  # the engine's default block (kvlab.cache.pool.DEFAULT_BLOCK_SIZE)


def cache_bytes_per_token(model, kv_cache_dtype: str) -> int:
    """Bytes every layer's pool holds per token (kvlab.plan's count: a one-block pool's nbytes)."""
    from kvlab.cache.pool import KVPool
    return KVPool.for_model(model.config, 1, BLOCK, kv_cache_dtype).nbytes() // BLOCK


def run(args: argparse.Namespace) -> dict:
    """Every setting's medians and ratios, printed as they finish; returned and, with --json, written."""
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [args.source, *args.models]
    models = {name: load_checkpoint(name, torch.float32, "q8_0").model for name in names}
    for name, model in models.items():
        if model.config.vocab_size != models[args.source].config.vocab_size:
            raise PlanError(f"{name} has another vocabulary than {args.source}: not a conversion of it")
    labels = {name: model.config.name for name, model in models.items()}
    cache = {name: cache_bytes_per_token(model, args.kv_cache_dtype) for name, model in models.items()}
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} at start; "
          f"weights q8_0, {args.kv_cache_dtype} pools of {BLOCK}-token blocks")
    for name in names:
        print(f"  {labels[name]}: {cache[name]:,} B of cache per token ({cache[name] / cache[args.source]:.3f}x)")
    settings = []
    for rows in args.rows:
        for context in args.contexts:
            contenders, keep = {}, []
            for name, model in models.items():
                pool, tables = random_pool(model, [context] * rows, args.kv_cache_dtype, block_size=BLOCK)
                reason = why_not_paged(model, pool)
                if reason is not None:
                    raise PlanError(f"{name} does not run in the C step: {reason}")
                batch = StepBatch.build([context] * rows, [1] * rows, tables, BLOCK)
                ids = torch.randint(0, model.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(1))
                step = PagedDecodeStep(model, pool, rows)
                keep.append(pool)
                contenders[labels[name]] = lambda s=step, i=ids, b=batch: s(i, b)
                if name != args.source and context == min(args.contexts):
                    def module_path(m=model, p=pool, i=ids, b=batch):
                        with torch.inference_mode():
                            return m(i[None], p, last_only=True, step=b)
                    contenders[f"{labels[name]} (module path)"] = module_path
            ms = median_ms(contenders, args.repeats)
            base = ms[labels[args.source]]
            speed = {label: base / value for label, value in ms.items()}
            settings.append({"rows": rows, "context": context, "ms": ms, "speed_vs_source": speed})
            print(f"{rows} row{'s' if rows > 1 else ''} at {context} tokens: " + ", ".join(
                f"{label} {value:.1f} ms ({speed[label]:.2f}x)" for label, value in ms.items()))
            del contenders, keep
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    result = {"source": args.source, "models": {name: {"name": labels[name], "cache_bytes_per_token": cache[name]}
                                                for name in names},
              "settings": settings,
              "config": {"contexts": args.contexts, "rows": args.rows, "kv_cache_dtype": args.kv_cache_dtype,
                         "repeats": args.repeats, "weights": "q8_0", "block_size": BLOCK},
              "provenance": provenance(args.threads)}
    if args.json:
        write_json(Path(args.json), result)
        print(f"wrote {args.json}")
    return result
