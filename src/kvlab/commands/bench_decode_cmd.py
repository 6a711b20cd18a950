"""`kvlab bench decode MODEL`: offline prefill and decode speed against batch and context, kvlab beside its peers."""

from __future__ import annotations

import argparse
import sys

from kvlab.commands.args import positive_float, positive_int, positive_int_list
from kvlab.plan.errors import PlanError

DECODE_HELP = ("offline prefill and decode throughput against batch size and context: kvlab, transformers generate "
               "and llama.cpp on the same GGUF, interleaved, as ratios to kvlab and fractions of the roofline")


def add_parser(benches) -> None:
    p = benches.add_parser("decode", help=DECODE_HELP, description=DECODE_HELP + ". Without --full-grid every "
                           "batch runs at the shortest context and every context at batch 1.")
    p.add_argument("model", help="a kvlab model name or GGUF file (e.g. smollm2-135m)")
    p.add_argument("--batch-sizes", type=positive_int_list, default=[1, 4, 8, 16, 32], help="default 1,4,8,16,32")
    p.add_argument("--contexts", type=positive_int_list, default=[128, 512, 1024, 2048, 4096],
                   help="prompt tokens before decoding (default 128,512,1024,2048,4096)")
    p.add_argument("--full-grid", action="store_true", help="every batch at every context (slow)")
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens decoded per sequence (default 16)")
    p.add_argument("--threads", type=positive_int, help="torch and llama.cpp threads (default: torch's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="kvlab's KV cache format (default auto)")
    p.add_argument("--transformers-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="transformers' weights (default bfloat16, its faster one here)")
    p.add_argument("--no-transformers", dest="transformers", action="store_false")
    p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    p.add_argument("--bandwidth-gbs", type=positive_float,
                   help="memory bandwidth for the roofline (default: measured once, kept in ~/.cache/kvlab)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", metavar="PATH", help="write every point of every engine, with provenance")
    p.add_argument("--batch-1-race", action="store_true",
                   help="instead: batch-1 greedy decode with the prompt included, kvlab fused and module by module "
                        "against transformers fp32 and bf16, --repeats timed runs each in turns "
                        "(kvlab.bench.decode_speed, what reports/decode_speed shows)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="turns of every engine at each point; each keeps its fastest prefill and decode (default 1)")
    p.add_argument("--repeats", type=positive_int, default=3, help="--batch-1-race: timed runs (default 3)")
    p.set_defaults(run=run_decode)


def run_decode(args: argparse.Namespace) -> int:
    if args.batch_1_race:
        from kvlab.bench.decode_speed import run_race

        new_tokens = 128 if args.new_tokens == 16 else args.new_tokens  # the race's own default
        return run_race(args.model, new_tokens, args.repeats, args.threads, transformers=args.transformers,
                        json_path=args.json)
    import torch
    from rich.console import Console

    from kvlab.bench.decode_sweep import (grid, kvlab_runner, llama_cpp_runner, roofline_tokens_per_s,
                                          sweep, transformers_runner)
    from kvlab.bench.provenance import provenance
    from kvlab.bench.throughput import random_prompts, special_ids
    from kvlab.checkpoints.resolve import load_model, resolve_model_path
    from kvlab.files import write_json
    from kvlab.commands.measure_cmd import weight_bytes_read
    from kvlab.train.progress import progress_bar

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = resolve_model_path(args.model)
    if not path.endswith(".gguf"):
        raise PlanError(f"{args.model}: bench decode runs every engine on one GGUF file; give one")
    loaded = load_model(path, torch.float32, "gguf")
    config = loaded.model.config
    longest = max(args.contexts) + args.new_tokens
    if longest > config.max_seq_len:
        raise PlanError(f"--contexts up to {max(args.contexts)} + --new-tokens {args.new_tokens} exceeds the "
                        f"model's {config.max_seq_len}-token context")
    say = lambda line: print(f"[kvlab bench decode] {line}", file=sys.stderr)  # noqa: E731
    engines = {"kvlab": kvlab_runner(loaded.model, args.kv_cache_dtype)}
    if args.transformers:
        engines[f"transformers ({args.transformers_dtype})"] = transformers_runner(
            path, getattr(torch, args.transformers_dtype))
    if args.llama_cpp:
        runner = llama_cpp_runner(path, threads)
        if runner is None:
            say("llama-cpp-python is not installed (pip install llama-cpp-python): llama.cpp skipped")
        else:
            engines["llama.cpp"] = runner
    if args.bandwidth_gbs:
        bandwidth, source = args.bandwidth_gbs, "--bandwidth-gbs"
    else:
        from kvlab.bench.bandwidth import machine_bandwidth_gbs
        bandwidth, source = machine_bandwidth_gbs()
    weights = weight_bytes_read(loaded.model)
    tok = loaded.tokenizer
    special = special_ids(tok)
    points = grid(args.batch_sizes, args.contexts, args.full_grid)
    for run in engines.values():  # warm-up: kernels built, weights paged in
        run(random_prompts(1, 8, config.vocab_size, args.seed + 1, special), 3)
    bar = progress_bar(len(points) * len(engines) * args.rounds, "decode points", unit="run",
                       enabled=sys.stderr.isatty())
    rows = sweep(engines, points, args.new_tokens,
                 lambda p: random_prompts(p.batch, p.context, config.vocab_size, args.seed, special),
                 lambda p: roofline_tokens_per_s(config, weights, p, args.new_tokens, bandwidth,
                                                 args.kv_cache_dtype),
                 bar.update if bar is not None else None, rounds=args.rounds)
    if bar is not None:
        bar.close()
    result = {"benchmark": "decode", "model": args.model, "gguf": path, "new_tokens": args.new_tokens,
              "engines": list(engines), "kv_cache_dtype": args.kv_cache_dtype, "bandwidth_gbs": round(bandwidth, 2),
              "bandwidth_source": source, "weight_bytes_read_per_step": weights,
              "order": "at each point the engines in turn; ratios are to kvlab at that point", "rounds": args.rounds,
              "points": rows,
              "provenance": provenance(threads)}
    Console(width=160).print(decode_table(result))
    if args.json:
        write_json(args.json, result)
        say(f"result written to {args.json}")
    return 0


def decode_table(result: dict):
    from rich.table import Table

    table = Table(title=f"kvlab bench decode: {result['model']}, {result['new_tokens']} new tokens, roofline at "
                        f"{result['bandwidth_gbs']} GB/s")
    table.add_column("batch", justify="right")
    table.add_column("context", justify="right")
    table.add_column("roofline tok/s", justify="right")
    for name in result["engines"]:
        table.add_column(f"{name}\ndecode tok/s (x kvlab, of roofline)", justify="right")
    for name in result["engines"]:
        table.add_column(f"{name}\nprefill tok/s (x kvlab)", justify="right")
    for row in result["points"]:
        cells = [str(row["batch"]), str(row["context"]), f"{row['roofline_decode_tokens_per_s']:,.0f}"]
        for name in result["engines"]:
            e = row["engines"][name]
            cells.append("-" if e["decode_tokens_per_s"] is None else
                         f"{e['decode_tokens_per_s']:,.1f} ({e['decode_ratio_to_kvlab']:.2f}x, "
                         f"{100 * e['decode_roofline_fraction']:.0f}%)")
        for name in result["engines"]:
            e = row["engines"][name]
            cells.append(f"{e['prefill_tokens_per_s']:,.0f} ({e['prefill_ratio_to_kvlab']:.2f}x)")
        table.add_row(*cells)
    return table
