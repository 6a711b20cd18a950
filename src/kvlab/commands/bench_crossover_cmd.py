"""`kvlab bench crossover MODEL`: where this machine's products of many rows are faster in the library than in C."""

from __future__ import annotations

import argparse
import sys

from kvlab.commands.args import add_model_flags

HELP = ("time each GGUF matrix shape of the model's first layer in kvlab's C kernels and in the library "
        "(torch/oneDNN, bf16 where the CPU has AMX or AVX-512 BF16, else fp32) at 2-256 rows, and remember "
        "the row count from which the library wins (the engine's crossover)")


def add_parser(benches) -> None:
    parser = benches.add_parser("crossover", help=HELP, description=HELP)
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="model (default smollm2-135m)")
    add_model_flags(parser, weights=("gguf", "gguf-a8"), weights_default="gguf", dtype=False)  # the kernels' packings
    parser.add_argument("--json", metavar="PATH", help="also write the table here, with provenance")
    parser.set_defaults(run=run_crossover)


def run_crossover(args: argparse.Namespace) -> int:
    from kvlab.bench.provenance import provenance
    from kvlab.engine.llm import load_for_engine
    from kvlab.nn import matmul_backend as mb
    from kvlab.nn.ggml import GGMLLinear
    from kvlab.files import write_json

    model, _ = load_for_engine(args.model, args.weights, threads=args.threads)
    shapes = {}
    for module in model.blocks[0].modules():
        if isinstance(module, GGMLLinear):
            shapes.setdefault((module.kind, module.out_features, module.in_features), module)
    if not shapes:
        print(f"{args.model} has no GGUF-block matrices (its weights load dense): every product is the library's")
        return 0
    rows = []
    for (kind, out, inp), layer in shapes.items():
        print(f"measuring {kind} {out}x{inp} ...", file=sys.stderr)
        figures = mb.measure(layer)
        mb.remember(layer, figures)  # the engine's crossover from now on
        rows.append({"kind": kind, "out": out, "in": inp, **figures})
    dtype = str(mb.library_dtype()).removeprefix("torch.")
    print(f"library: torch {dtype} on a dense copy; kernels: kvlab C on the GGUF blocks ({args.weights})")
    print("shape            " + "".join(f"{r:>9d}" for r in mb.ROWS) + "   crossover (rows)")
    for row in rows:
        ratios = [row["seconds"][str(r)][0] / row["seconds"][str(r)][1] for r in mb.ROWS]
        where = "never" if row["crossover"] >= mb.NEVER else str(row["crossover"])
        print(f"{row['kind']:5s} {row['out']:5d}x{row['in']:<5d}" + "".join(f"{x:8.2f}x" for x in ratios)
              + f"   {where}")
    print(f"(cells: C time / library time; above 1 the library is faster; remembered in {mb.CACHE_FILE})")
    if args.json:
        write_json(args.json, {"benchmark": "crossover", "model": args.model, "library_dtype": dtype,
                               "rows": list(mb.ROWS), "shapes": rows, "provenance": provenance(args.threads)})
    return 0
