"""`kvlab bench throughput MODEL` (offline, through the engine) and `kvlab bench serve` (a server under load)."""

from __future__ import annotations

import argparse
import sys

from kvlab.commands.args import positive_int
from kvlab.commands.engine_args import add_engine_arguments
from kvlab.files import write_json
from kvlab.plan.errors import PlanError

THROUGHPUT_HELP = "N random prompts through the engine at once: request and token throughput"


def add_parser(subparsers, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(run=lambda args: parser.error("choose a benchmark (kvlab bench --help lists them)"))
    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    tp = benches.add_parser("throughput", help=THROUGHPUT_HELP, description=THROUGHPUT_HELP)
    add_engine_arguments(tp)
    work = tp.add_argument_group("workload")
    work.add_argument("--num-prompts", type=positive_int, default=16, help="requests (default 16)")
    work.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens each (default 128)")
    work.add_argument("--output-len", type=positive_int, default=128, help="new tokens each (default 128)")
    work.add_argument("--dataset-seed", type=int, default=0, help="seed of the random prompts (default 0)")
    work.add_argument("--baselines", action="store_true",
                      help="also run, in the same process: the engine one request at a time, and plain "
                           "`kvlab generate` on one prompt (the ratios' denominators)")
    work.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false",
                      help="skip llama.cpp's batched decode on the same GGUF (run when llama-cpp-python is installed)")
    tp.add_argument("--json", metavar="PATH", help="write the result with provenance here")
    tp.set_defaults(run=run_throughput)
    from kvlab.commands import (bench_compare_cmd, bench_crossover_cmd, bench_decode_cmd, bench_hybrid_cmd,
                                bench_lab_cmd, bench_mla_cmd, bench_paged_cmd, bench_real_models_cmd, bench_serve_cmd,
                                bench_serving_cmd, bench_shared_cpu_cmd, bench_speculative_cmd)
    bench_serve_cmd.add_parser(benches)
    bench_compare_cmd.add_parser(benches)
    bench_decode_cmd.add_parser(benches)
    bench_paged_cmd.add_parser(benches)
    bench_mla_cmd.add_parser(benches)
    bench_shared_cpu_cmd.add_parser(benches)
    bench_crossover_cmd.add_parser(benches)
    bench_hybrid_cmd.add_parser(benches)
    bench_serving_cmd.add_parsers(benches)
    bench_speculative_cmd.add_parsers(benches)
    bench_real_models_cmd.add_parsers(benches)
    bench_lab_cmd.add_parsers(benches)


def run_throughput(args: argparse.Namespace) -> int:
    from kvlab.bench.provenance import provenance
    from kvlab.bench.throughput import random_prompts, run_engine, run_generate, special_ids
    from kvlab.checkpoints.resolve import resolve_model_path
    from kvlab.commands.engine_args import engine_from_args
    from kvlab.train.progress import progress_bar

    if args.max_num_seqs < args.num_prompts:
        print(f"kvlab bench: note: --max-num-seqs {args.max_num_seqs} < --num-prompts {args.num_prompts}; "
              "the rest wait their turn", file=sys.stderr)
    engine = engine_from_args(args)
    for line in engine.capacity_lines + [engine.products_line]:
        print(f"[kvlab] {line}", file=sys.stderr)
    tok = engine.tokenizer
    special = special_ids(tok)
    # the batched run's prompts, then three of their own for the warm-up and the batch-1 baselines
    # (the first num_prompts are the same whatever the count: random_prompts draws them in order)
    prompts = random_prompts(args.num_prompts + 3, args.input_len, engine.model.config.vocab_size,
                             args.dataset_seed, special)
    prompts, warm_up, solo = prompts[:args.num_prompts], prompts[-3], prompts[-2:]
    if args.input_len + args.output_len > engine.max_model_len:
        raise PlanError(f"--input-len + --output-len exceeds the model length {engine.max_model_len}")
    run_engine(engine, [warm_up], 4)  # kernels built, pages touched
    bar = progress_bar(args.num_prompts, "requests", unit="req", enabled=sys.stderr.isatty())
    result = {"benchmark": "throughput", "model": args.model, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "kv_cache_dtype": args.kv_cache_dtype,
              "max_num_seqs": args.max_num_seqs, "block_size": engine.config.block_size,
              "capacity_lines": engine.capacity_lines, "products": engine.products_line,
              "batched": run_engine(engine, prompts, args.output_len, progress=bar)}
    if bar is not None:
        bar.close()
    if args.baselines:
        result["engine_one_at_a_time"] = run_engine(engine, solo, args.output_len, concurrency=1)
        result["generate_batch_1"] = run_generate(engine.model, solo[0], args.output_len)
        one = result["engine_one_at_a_time"]["output_tokens_per_s"]
        result["ratio_batched_vs_engine_batch_1"] = result["batched"]["output_tokens_per_s"] / one
        result["ratio_engine_batch_1_vs_generate"] = one / result["generate_batch_1"]["output_tokens_per_s"]
    path = resolve_model_path(args.model)
    if args.llama_cpp and path.endswith(".gguf"):
        import torch

        from kvlab.bench.llama_cpp_batch import run_llama_cpp
        theirs = run_llama_cpp(path, prompts, args.output_len, args.threads or torch.get_num_threads())
        if theirs is None:
            print("kvlab bench: llama-cpp-python is not installed (pip install llama-cpp-python); "
                  "llama.cpp's batched decode skipped", file=sys.stderr)
        else:
            result["llama_cpp_batched"] = {k: v for k, v in theirs.items() if k != "outputs"}
            result["ratio_batched_vs_llama_cpp"] = result["batched"]["output_tokens_per_s"] / \
                theirs["output_tokens_per_s"]
    result["provenance"] = provenance(args.threads)
    b = result["batched"]
    print(f"Throughput: {b['requests_per_s']:.2f} requests/s, {b['total_tokens_per_s']:.1f} total tokens/s, "
          f"{b['output_tokens_per_s']:.1f} output tokens/s ({b['num_requests']} requests, {b['elapsed_s']:.1f} s, "
          f"decode {b['decode_path']}, {b['preemptions']} preemptions)")
    if args.baselines:
        print(f"Engine one request at a time: {result['engine_one_at_a_time']['output_tokens_per_s']:.1f} output "
              f"tokens/s; kvlab generate (batch 1): {result['generate_batch_1']['output_tokens_per_s']:.1f}")
        print(f"Ratios: batched / engine batch 1 = {result['ratio_batched_vs_engine_batch_1']:.2f}x; "
              f"engine batch 1 / generate = {result['ratio_engine_batch_1_vs_generate']:.2f}x")
    if "llama_cpp_batched" in result:
        print(f"llama.cpp batched decode (llama_batch, one sequence id per request): "
              f"{result['llama_cpp_batched']['output_tokens_per_s']:.1f} output tokens/s; kvlab / llama.cpp = "
              f"{result['ratio_batched_vs_llama_cpp']:.2f}x")
        if not result["llama_cpp_batched"].get("weight_repacking", True):
            print("(llama.cpp ran with its weight repacking off: this build has AMX kernels, which crash on this "
                  "GGUF; kvlab.bench.llama_cpp_batch.AMX_REBUILD says how to build it without)")
    if args.json:
        write_json(args.json, result)
    return 0
