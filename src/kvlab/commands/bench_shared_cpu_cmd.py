"""`kvlab bench shared-cpu`: batch-1 and batched speed beside a busy core, with and without the thread governor."""

from __future__ import annotations

import argparse
import sys

from kvlab.commands.args import positive_int

HELP = ("kvlab measure and kvlab bench throughput on a quiet machine and beside one busy process, with every step "
        "on all threads (KVLAB_THREADS=fixed) and with the thread governor (the default), taking turns")


def add_parser(benches) -> None:
    parser = benches.add_parser("shared-cpu", help=HELP, description=HELP)
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="model (default smollm2-135m)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="runs per contender (median; 3)")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="new tokens per request (64)")
    parser.add_argument("--only", choices=["measure", "throughput"], action="append",
                        help="run only this command (repeatable; default both)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here, with provenance")
    parser.set_defaults(run=run_shared_cpu)


def run_shared_cpu(args: argparse.Namespace) -> int:
    from kvlab.bench.provenance import provenance
    from kvlab.bench.shared_cpu import POLICIES, run
    from kvlab.files import write_json
    from kvlab.train.progress import progress_bar

    per_command = 2 * args.rounds * len(POLICIES)
    bar = progress_bar(per_command * len(args.only or [0, 0]), "runs", unit="run", enabled=sys.stderr.isatty())
    result = run(args.model, args.rounds, args.new_tokens, args.only, bar)
    if bar is not None:
        bar.close()
    result["provenance"] = provenance()
    for name, summary in result["summary"].items():
        for load, medians in summary["median"].items():
            cells = ", ".join(f"{p} {v:.1f}" for p, v in medians.items())
            print(f"{name:10s} {load:18s} output tok/s (median): {cells}")
        shares = ", ".join(f"{p} {v:.2f}" for p, v in summary["loaded_share_of_quiet"].items())
        print(f"{name:10s} beside a busy core / quiet: {shares} (a fair share is about 0.5)")
    if args.json:
        write_json(args.json, result)
    return 0
