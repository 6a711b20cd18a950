"""`kvlab plan`: the planner's figures for one model, or a comparison across variants and dtypes."""

from __future__ import annotations

import argparse
import json
import sys

from kvlab.commands.args import comma_list
from kvlab.commands.plan_args import (add_model_arguments, add_request_arguments, cards_from_args, model_from_args,
                                     request_from_args)
from kvlab.plan.errors import PlanError
from kvlab.plan.hardware import CATALOG
from kvlab.plan.presets import preset_names

EXAMPLES = """examples:
  kvlab plan llama-3-8b --gpu h100-sxm --context 8192
  kvlab plan llama-3-8b --gpu h100,l40s,l4 --context 32768 --batch 16      # which card / TP serves it
  kvlab plan llama-2-70b --kv-heads 8 --kv-cache-memory 40GiB --json
  kvlab plan path/to/config.json --kv-cache-dtype fp8 --gpu l40s --engine vllm
  kvlab plan --layers 40 --heads 32 --kv-heads 8 --head-dim 128 --kv-cache-memory 9GiB
  kvlab plan llama-3-8b --gpu h100-sxm --compare mha,gqa:8,mqa,mla --compare-dtypes fp16,fp8
"""


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text, epilog=EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    add_request_arguments(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--compare", type=comma_list, metavar="VARIANTS",
                        help="compare variants, e.g. base,mha,gqa:8,mqa,mla")
    output.add_argument("--compare-dtypes", type=comma_list, metavar="DTYPES",
                        help="KV dtypes for --compare, e.g. fp16,fp8,int4 (default: --kv-cache-dtype)")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    output.add_argument("--list-presets", action="store_true", help="list preset model names and exit")
    output.add_argument("--list-gpus", action="store_true", help="list catalog cards with sources and exit")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.list_presets or args.list_gpus:
        listing = preset_names() if args.list_presets else {key: vars(card) for key, card in CATALOG.items()}
        print(json.dumps(listing, indent=2) if args.json or args.list_gpus else "\n".join(listing))
        return 0
    spec = model_from_args(args)
    cards = cards_from_args(args)
    request = request_from_args(args, cards[0] if cards else None)
    if len(cards) > 1:
        if args.compare or args.compare_dtypes:
            raise PlanError("--compare plans one card; give one --gpu")
        from kvlab.plan.inverse import card_rows
        result = card_rows(spec, request, cards, args.tensor_parallel_size)
    elif args.compare or args.compare_dtypes:
        from kvlab.plan.compare import compare
        rows = compare(spec, request, args.compare or ["base"], args.compare_dtypes or [args.kv_cache_dtype])
        result = {"model": spec.name, "inputs": {"context": request.context, "batch": request.batch}, "rows": rows}
    else:
        from kvlab.plan.planner import plan
        result = plan(spec, request)
    for warning in request.warnings:
        print(f"kvlab plan: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from rich.console import Console
    from kvlab.report.plan_table import render_cards, render_comparison, render_plan
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # pipes and logs get whole rows, not 80-column wraps
    if "cards" in result:
        render_cards(result, console)
    elif "rows" in result:
        render_comparison(result["rows"], console, f"{spec.name} @ {request.context:,} tokens, batch {request.batch}")
    else:
        render_plan(result, console)
    return 0
