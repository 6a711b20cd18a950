"""`kvlab bench speculative` and `kvlab bench eagle`: speculative decoding measured on SmolLM2, with their reports.

The measurements live in kvlab.bench.speculative and kvlab.bench.eagle (results.json with
provenance); the pages in kvlab.report.speculative and kvlab.report.eagle. This file holds the
parsers and writes results.json and README.md into --out (the speculative run after every cell,
so a stopped run keeps what it measured). `kvlab report speculative|eagle` re-renders a page alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.commands.args import non_negative_float, positive_int

SPECULATIVE = ("speculative decoding against plain decoding: n-gram, self-draft and the trained drafts, at batch 1 "
               "and 8, chat and predictable prompts, greedy and sampled; reports/speculative")
EAGLE = "an EAGLE head (kvlab draft train --method eagle): acceptance per draft position and the batch-1 speed-up"


def add_parsers(benches) -> None:
    p = benches.add_parser("speculative", help=SPECULATIVE, description=SPECULATIVE)
    p.add_argument("--model", default="smollm2-135m", help="target model (default smollm2-135m)")
    p.add_argument("--draft-xs", help="trained draft xs (default ~/.cache/kvlab/drafts/smollm2-draft-xs)")
    p.add_argument("--draft-s", help="trained draft s (default ~/.cache/kvlab/drafts/smollm2-draft-s)")
    p.add_argument("--self-layers", type=positive_int, default=6, help="self-draft depth (default 6 of 30)")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--prompts-b1", type=positive_int, default=4,
                   help="requests at batch 1, one after another (default 4)")
    p.add_argument("--out", type=Path, default=Path("reports/speculative"),
                   help="folder for results.json and README.md (default reports/speculative)")
    p.add_argument("--quick", action="store_true",
                   help="k = 3 for every method, k in {1, 2, 4, 6} for the trained drafts at batch 1, greedy")
    p.add_argument("--smoke", action="store_true", help="a tiny grid (k 1-2), to check the pipeline")
    p.set_defaults(run=run_speculative)

    p = benches.add_parser("eagle", help=EAGLE, description=EAGLE)
    p.add_argument("--model", default="smollm2-135m", help="target model (default smollm2-135m)")
    p.add_argument("--head", help="the head (default ~/.cache/kvlab/drafts/smollm2-eagle)")
    p.add_argument("--method", nargs="+", choices=("eagle", "medusa"), default=["eagle"],
                   help="head kinds to run (default eagle)")
    p.add_argument("--medusa-head", help="the Medusa head set, kvlab draft train --method medusa (default "
                   "~/.cache/kvlab/drafts/smollm2-medusa)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1], help="concurrent requests (default 1)")
    p.add_argument("--temperature", type=non_negative_float, nargs="+", default=[0.0],
                   help="sampling temperatures (default 0: greedy)")
    p.add_argument("--k", type=positive_int, nargs="+", default=[1, 2, 3],
                   help="num_speculative_tokens (default 1 2 3)")
    p.add_argument("--prompts", type=positive_int, default=6,
                   help="held-out chat prompts, one after another (default 6)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--out", type=Path, default=Path("reports/speculative/eagle"),
                   help="folder for results.json and README.md (default reports/speculative/eagle)")
    p.set_defaults(run=run_eagle)


def run_speculative(args: argparse.Namespace) -> int:
    from kvlab.bench.speculative import run_command
    from kvlab.report.speculative import write_report

    result = run_command(args, on_cell=lambda partial: write_report(partial, args.out))
    write_report(result, args.out)
    print(f"wrote {args.out}/results.json and {args.out}/README.md")
    return 0


def run_eagle(args: argparse.Namespace) -> int:
    from kvlab.bench.eagle import run_command
    from kvlab.files import write_atomic, write_json
    from kvlab.report.eagle import render

    result = run_command(args)
    write_json(args.out / "results.json", result)
    write_atomic(args.out / "README.md", render(result))
    print(render(result))
    return 0
