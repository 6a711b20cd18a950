"""Decode steps over the engine's paged pool: the C step (kvlab.nn.paged_decode) against the module path.

    kvlab bench paged-decode [--repeats 15] [--rows 16] [--context 4096] [--threads N]
                             [--block-sizes 16,64] [--formats fp16,int8,fp8] [--kv-calibration FILE]
                             [--json PATH]

(its flags are kvlab.commands.bench_paged_cmd's; this module measures and writes the JSON).

Two measurements on SmolLM2-135M (Q4_1 GGUF blocks, fp32 activations), each a ratio within
one run, the contenders taking turns so that load from other processes falls on all alike:

1. `--rows` sequences at mixed positions (evenly from 64 to 1,024 tokens, shuffled blocks of 16
   tokens), one decode step for all of them: C step against the module path, fp16 pool;
2. one sequence, then `--rows` sequences, at `--context` tokens: the C step on fp16, int8 and
   fp8 (e4m3) pools (or `--formats`: int4, int2, kivi4, kivi2, kvquant4, kvquant3), where the narrow pools read about half
   of fp16's bytes in attention (int4 with its fp16 scale and zero per 64 channels 0.28, int2 0.16). At
   one row the weights (112 MB a step) are read as often as SmolLM2's 94 MB of fp16 K/V at
   4,096 tokens, so halving the K/V can gain at most about 1.25x; at 16 rows the K/V is 93% of
   the bytes. Measured at each of `--block-sizes`: an attention unit reads one KV head's rows
   of each block, one contiguous run of block_size x head_dim codes between jumps to wherever
   the next block sits (1 KiB for int8 at 16 tokens, 2 KiB for fp16), and on this kind of
   machine short runs cost int8 more per byte than fp16 (vLLM's CPU backend defaults to
   128-token blocks and warns below multiples of 32).

KVQuant pools take their codebooks from `--kv-calibration` (SmolLM2's is
reports/real-models/smollm2-135m.kvquant.safetensors), else from a calibration fitted on random
activations (the codebooks' values do not change a step's time); their key outlier counts are set so
that every other row keeps one outlier (half a slot a row, under the 1% pools' 0.64 for SmolLM2's
64-channel heads: the pool fills about as a real one does), each row in its own seat.

The pools are filled with random K/V rather than a prefill (minutes of CPU for the 16 rows);
a step's time does not depend on the values. Medians of `--repeats` steps after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from kvlab.bench.provenance import provenance
from kvlab.cache.pool import KVPool
from kvlab.cache.step import StepBatch
from kvlab.checkpoints.resolve import load_checkpoint
from kvlab.nn.paged_decode import PagedDecodeStep
from kvlab.files import write_json

BLOCK = 16  # the mixed-position step's blocks: vLLM's GPU default, so rows cross many block boundaries


def random_pool(model, positions: list[int], kv_cache_dtype: str, seed: int = 0,
                block_size: int = BLOCK, calibration=None) -> tuple[KVPool, list[list[int]]]:
    """A pool holding random K/V for rows decoding at `positions`, with shuffled block tables (KVQuant and
    KIVI pools: row r in seat r; KVQuant's with `calibration`'s codebooks)."""
    need = [pos // block_size + 1 for pos in positions]
    kvquant, kivi = kv_cache_dtype.startswith("kvquant"), kv_cache_dtype.startswith("kivi")
    seated = kvquant or kivi  # a seat per row: KVQuant's sinks and outliers, KIVI's residual ring
    pool = KVPool.for_model(model.config, sum(need), block_size, kv_cache_dtype, seats=len(positions) if seated else 0,
                            calibration=calibration, max_tokens=max(positions) + 2)
    generator = torch.Generator().manual_seed(seed)
    if kvquant:
        fill_kvquant(pool, generator)
    for tensor in ([] if kvquant else pool.tensors()):
        if tensor.dtype == torch.uint8:
            tensor.copy_(torch.randint(0, 256, tensor.shape, generator=generator, dtype=torch.uint8))
        elif tensor.dtype == torch.float16 and (kivi or kv_cache_dtype in ("int8", "int4", "int2")):  # scale, zero
            tensor.copy_(torch.rand(tensor.shape, generator=generator) * 0.01)
        else:
            tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    order = torch.randperm(pool.num_blocks, generator=generator).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    return pool, tables


def fill_kvquant(pool: KVPool, generator: torch.Generator) -> None:
    """Random KVQuant rows: codes, value scales and zeros, outliers at real channels; one key outlier every
    other row (below the pool's capacity, so every row's outliers are in its seat's pool)."""
    planes, dim = pool.kvquant, pool.k_head_dim
    for layer in range(pool.num_layers):
        fields = planes.v_fields[layer]
        for codes in (planes.k_codes[layer], fields["codes"]):
            codes.copy_(torch.randint(0, 256, codes.shape, generator=generator, dtype=torch.uint8))
        planes.k_counts[layer].copy_((torch.arange(pool.block_size) % 2 == 0).view(1, 1, -1, 1).expand_as(
            planes.k_counts[layer]))
        for index in (fields["outlier_index"], planes.k_outlier_index[layer]):
            index.copy_(torch.randint(0, dim, index.shape, generator=generator).to(index.dtype))
        fields["scale"].copy_(torch.rand(fields["scale"].shape, generator=generator) * 0.01)
        for values in (fields["zero"], fields["outlier_values"], planes.k_sink[layer], planes.v_sink[layer],
                       planes.k_outliers[layer]):
            values.copy_(torch.randn(values.shape, generator=generator).to(values.dtype))


def bench_calibration(model, path):
    """`path`'s KVQuant calibration for `model`, or one fitted on random activations (see the module doc)."""
    from kvlab.cache.kvquant_calibration import KVQuantCalibration, fit_layer, load_calibration

    if path:
        return load_calibration(Path(path), model.config)
    generator = torch.Generator().manual_seed(0)
    config = model.config
    shape = (config.kv_heads, 64, config.head_size)
    layers = [fit_layer(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(config.n_layers)]
    return KVQuantCalibration(config.kv_heads, config.head_size, layers, {"random": True})


def median_ms(contenders: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each contender's median time in ms, the contenders taking turns (one warm-up call each)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for name, run in contenders.items():
        run()
    for _ in range(repeats):
        for name, run in contenders.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def run(args: argparse.Namespace) -> dict:
    """Both measurements, printed as they finish; the figures (with provenance) returned and, with --json, written."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_checkpoint("smollm2-135m", torch.float32, "gguf").model
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} at start")

    positions = torch.linspace(64, 1024, args.rows).long().tolist()
    pool, tables = random_pool(model, positions, "fp16")
    batch = StepBatch.build(positions, [1] * args.rows, tables, BLOCK)
    ids = torch.randint(0, model.config.vocab_size, (args.rows,), generator=torch.Generator().manual_seed(1))
    step = PagedDecodeStep(model, pool, args.rows)

    def module_path():
        with torch.inference_mode():
            return model(ids[None], pool, last_only=True, step=batch)

    batched = median_ms({"C step": lambda: step(ids, batch), "module path": module_path}, args.repeats)
    print(f"{args.rows} rows at positions {positions[0]}..{positions[-1]} (fp16 pool): "
          f"C step {batched['C step']:.1f} ms, module path {batched['module path']:.1f} ms, "
          f"{batched['module path'] / batched['C step']:.2f}x")

    calibration = bench_calibration(model, getattr(args, "kv_calibration", None)) \
        if any(dtype.startswith("kvquant") for dtype in args.formats) else None
    by_block = {}
    for block_size in args.block_sizes:
        long = by_block[block_size] = {}
        for rows in sorted({1, args.rows}):
            steps = {}
            for dtype in args.formats:
                long_pool, tables = random_pool(model, [args.context] * rows, dtype, block_size=block_size,
                                                calibration=calibration)
                at = StepBatch.build([args.context] * rows, [1] * rows, tables, block_size)
                steps[dtype] = (PagedDecodeStep(model, long_pool, rows), at)
                del long_pool  # the step keeps what it reads; the short-context pool above stays the module path's
            tokens = ids[:rows]
            long[rows] = median_ms({dtype: (lambda s=s, b=b: s(tokens, b)) for dtype, (s, b) in steps.items()},
                                   args.repeats)
            print(f"{rows} row{'s' if rows > 1 else ''} at {args.context} tokens, {block_size}-token blocks, "
                  "C step: " + ", ".join(f"{dtype} {ms:.1f} ms ({long[rows]['fp16'] / ms:.2f}x fp16's speed)"
                                         for dtype, ms in long[rows].items()))
            del steps
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    result = {"batched_ms": batched, "long_context_by_block_size_ms": by_block,
              "settings": {"rows": args.rows, "context": args.context, "repeats": args.repeats,
                           "block_sizes": args.block_sizes, "formats": args.formats,
                           "kv_calibration": getattr(args, "kv_calibration", None),
                           "seed": 0},
              "provenance": provenance(args.threads)}
    if args.json:
        write_json(Path(args.json), result)
        print(f"wrote {args.json}")
    return result
