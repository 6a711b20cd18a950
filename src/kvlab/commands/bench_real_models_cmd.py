"""`kvlab bench real-models`, `kvlab bench kvquant-split`, `kvlab bench conversions` and `kvlab bench
vllm-conversions`: the real-model reports' measurements (resumable where they are long).

Each measures into the JSON of its report folder (kvlab.bench.real_models, kvquant_split,
conversions, vllm_conversions, with provenance) and then renders the page from that JSON
(kvlab.report.*); `kvlab report NAME` re-renders a page alone. This file holds only the parsers
and that order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.commands.args import non_negative_float, positive_int

REAL_MODELS = ("reports/real-models: SmolLM2-135M and Gemma 3 270M under every KV setting (perplexity, passkey), "
               "seats per card, the engine's capacity and throughput; resumable: repeat until it prints complete")
KVQUANT_SPLIT = ("which half of KVQuant's perplexity cost is its keys' and which its values', and the best a "
                 "calibration could reach (reports/real-models/kvquant_split.json)")
CONVERSIONS = ("reports/conversions: SmolLM2 against its MQA and MLA conversions before and after uptraining, in "
               "kvlab's server and real vLLM; resumable: repeat until it prints complete")
VLLM_CONVERSIONS = ("SmolLM2's KV-head conversions in real vLLM: its logged KV capacity against kvlab plan's, and "
                    "its greedy text against kvlab's (reports/real-models/conversions.json and .md)")


def add_parsers(benches) -> None:
    p = benches.add_parser("real-models", help=REAL_MODELS, description=REAL_MODELS)
    p.add_argument("--out", type=Path, help="report folder (default reports/real-models)")
    p.add_argument("--max-seconds", type=non_negative_float, default=540,
                   help="start no cell after this many seconds (default 540; 0 only tabulates and renders)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
    p.add_argument("--only", help="run only the steps whose key starts with one of these comma-separated prefixes: "
                   "smollm2:LABEL (a row's quality cells), throughput:LABEL (its engine run), uptrain, gemma:LABEL, "
                   "gemma-throughput:LABEL (e.g. throughput:kivi,throughput:kvquant); the table is tabulated and rendered as always")
    p.set_defaults(run=run_real_models)

    p = benches.add_parser("kvquant-split", help=KVQUANT_SPLIT, description=KVQUANT_SPLIT)
    p.add_argument("--kv-cache-dtype", default="kvquant3", choices=["kvquant3", "kvquant4"],
                   help="the KVQuant format (default kvquant3)")
    p.add_argument("--out", type=Path, help="the JSON (default reports/real-models/kvquant_split.json)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
    p.set_defaults(run=run_kvquant_split)

    p = benches.add_parser("conversions", help=CONVERSIONS, description=CONVERSIONS)
    p.add_argument("--max-seconds", type=non_negative_float, default=1080.0,
                   help="start no step after this many seconds (default 1080; 0 only renders)")
    p.add_argument("--out", type=Path, help="report folder (default reports/conversions)")
    p.add_argument("--only", help="run only the steps whose key starts with one of these comma-separated prefixes "
                   "(e.g. convert:mqa,quality:mqa)")
    p.set_defaults(run=run_conversions)

    p = benches.add_parser("vllm-conversions", help=VLLM_CONVERSIONS, description=VLLM_CONVERSIONS)
    p.add_argument("--variants", default="original,mqa", help="comma list of original, mqa, mha (default original,mqa)")
    p.add_argument("--vllm-python", help="the vLLM venv's python (default $KVLAB_VLLM_PYTHON or "
                   "/work/venv-vllm/bin/python)")
    p.add_argument("--no-mla", action="store_true", help="skip the MLA conversion's export refusal")
    p.add_argument("--budget-s", type=non_negative_float, default=900.0, help="start no further variant once vLLM "
                   "time so far plus the longest variant would pass this (default 900)")
    p.add_argument("--json", metavar="PATH", help="write the result here and its .md beside it")
    p.set_defaults(run=run_vllm_conversions)


def run_real_models(args: argparse.Namespace) -> int:
    from kvlab.bench import real_models
    from kvlab.report.real_models import render

    out = args.out or real_models.OUT
    out.mkdir(parents=True, exist_ok=True)
    done = real_models.measure(out, args.max_seconds, args.threads, args.only) if args.max_seconds > 0 else None
    real_models.tabulate(out)
    render(out)
    state = "tabulated" if done is None else "complete" if done else "incomplete: run it again to measure the rest"
    print(f"real_models: {state}; wrote {out / 'serving.json'} and {out / 'README.md'}")
    return 0


def run_kvquant_split(args: argparse.Namespace) -> int:
    from kvlab.bench.kvquant_split import run_command
    return run_command(args)


def run_conversions(args: argparse.Namespace) -> int:
    from kvlab.bench import conversions
    from kvlab.bench.real_models import shared_file
    from kvlab.report.conversions import write

    shared_file("data", "english", conversions.EVAL_TEXT)  # the shared folder must be there
    out = args.out or conversions.OUT
    complete = conversions.run(args.max_seconds, args.only, out)
    write(out)
    print("complete" if complete else "not complete yet: run the same command again")
    return 0


def run_vllm_conversions(args: argparse.Namespace) -> int:
    from kvlab.bench.vllm_conversions import run_command
    from kvlab.files import write_atomic
    from kvlab.report.vllm_conversions import render

    result = run_command(args)
    text = render(result)
    if args.json:
        write_atomic(Path(args.json).with_suffix(".md"), text)
    print(text)
    return 0 if all(r.get("capacity_matches_plan") for r in result["variants"]) else 1
