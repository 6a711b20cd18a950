"""`kvlab bench hybrid-step MODEL`: decode and verification steps with library products and C attention,
against the fused C step, on this machine (kvlab.bench.hybrid_step)."""

from __future__ import annotations

import argparse
import sys

from kvlab.commands.args import add_model_flags, positive_int

HELP = ("time a decode step of R rows and a verification of n tokens on the fused C step and on the hybrid step "
        "(products in the library: torch/oneDNN, bf16 where the CPU has AMX or AVX-512 BF16, else fp32; "
        "attention in C over the pool), which the engine takes at or above the crossover")


def _rows(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected row counts like 1,16,32, got {text!r}")
    return values


def _context(text: str) -> int:
    value = positive_int(text)
    if value % 16:
        raise argparse.ArgumentTypeError(f"expected a multiple of 16 (the pool's blocks), got {text!r}")
    return value


def add_parser(benches) -> None:
    parser = benches.add_parser("hybrid-step", help=HELP, description=HELP)
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="model (default smollm2-135m)")
    add_model_flags(parser, weights=("gguf", "gguf-a8"), weights_default="gguf", dtype=False)  # the kernels' packings
    parser.add_argument("--rows", type=_rows, default=[1, 16, 32], help="decode rows, comma-separated (default 1,16,32)")
    parser.add_argument("--context", type=_context, default=256,
                        help="tokens of K/V each row reads, a multiple of 16 (default 256)")
    parser.add_argument("--repetitions", type=positive_int, default=5, help="medians over this many (default 5)")
    parser.add_argument("--iterations", type=positive_int, default=4, help="calls timed in a row (default 4)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here, with provenance")
    parser.set_defaults(run=run_hybrid)


def run_hybrid(args: argparse.Namespace) -> int:
    from kvlab.bench.hybrid_step import measure_decode_steps, measure_verification
    from kvlab.bench.provenance import provenance
    from kvlab.engine.llm import load_for_engine
    from kvlab.files import write_json
    from kvlab.nn.matmul_backend import library_dtype

    model, tokenizer = load_for_engine(args.model, args.weights, threads=args.threads)
    print("timing decode steps ...", file=sys.stderr)
    decode = measure_decode_steps(model, tokenizer, args.rows, args.context, args.repetitions, args.iterations)
    if not decode:
        print(f"{args.model} has no fused C step or no hybrid step here: nothing to compare")
        return 0
    print("timing verifications ...", file=sys.stderr)
    verify = measure_verification(model, tokenizer, args.context, args.repetitions, args.iterations)
    dtype = str(library_dtype()).removeprefix("torch.")
    print(f"decode step at {args.context} tokens of context, ms (library: torch {dtype}; C: {args.weights} blocks)")
    print("rows   fused   hybrid   hybrid/fused")
    for r, row in decode["rows"].items():
        if row["hybrid_ms"] is None:
            print(f"{r:>4s} {row['fused_ms']:7.2f}        -              -")
        else:
            print(f"{r:>4s} {row['fused_ms']:7.2f} {row['hybrid_ms']:8.2f} {row['hybrid_over_fused']:13.2f}x")
    if verify:
        print("verification of n tokens of one sequence, ms (over the fused one-token step)")
        print("   n        fused            hybrid")
        for key, fused_ms in verify["fused"]["step_ms"].items():
            n, hybrid_ms = key.split(":")[1], verify["hybrid"]["step_ms"][key]
            print(f"{n:>4s} {fused_ms:7.2f} ({verify['fused']['over_fused_plain'][n]:4.2f}x) "
                  f"{hybrid_ms:8.2f} ({verify['hybrid']['over_fused_plain'][n]:4.2f}x)")
    if args.json:
        write_json(args.json, {"benchmark": "hybrid_step", "model": args.model, "weights": args.weights,
                               "library_dtype": dtype, "decode": decode, "verification": verify,
                               "provenance": provenance(args.threads)})
    return 0
