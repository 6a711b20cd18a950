"""`kvlab chart`: the interactive KV-cache page (self-contained HTML) and an optional PNG."""

from __future__ import annotations

import argparse
import os
import sys

from kvlab.commands.args import byte_size, positive_int
from kvlab.commands.plan_args import add_model_arguments, device_from_args, model_from_args
from kvlab.plan.errors import PlanError

DEFAULT_BUDGET = 16 * 2**30


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text,
                                   epilog="example: kvlab chart llama-3-8b --gpu h100-sxm --context 8192 --batch 8")
    add_model_arguments(parser)
    parser.add_argument("--context", type=positive_int, default=4096, help="marked context (4096)")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences (1)")
    parser.add_argument("--bits", type=int, choices=(16, 8, 4, 2), default=16, help="starting KV precision (16)")
    parser.add_argument("--kv-cache-memory", type=byte_size, help="budget line, e.g. 40GiB (default: the card's "
                                                                  "cache budget with --gpu, else 16GiB)")
    parser.add_argument("--gpu", help="card from the catalog: its cache budget after weights is the budget line")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--memory-gib", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth-gbs", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--tflops", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", "-o", default="kvlab-chart.html", help="HTML file to write (kvlab-chart.html)")
    parser.add_argument("--png", help="also write a static PNG here")
    parser.set_defaults(run=run)


def _budget(args: argparse.Namespace, spec) -> int:
    if args.kv_cache_memory:
        return args.kv_cache_memory
    card = device_from_args(args)
    if card is None:
        return DEFAULT_BUDGET
    from kvlab.plan.planner import PlanRequest, plan
    result = plan(spec, PlanRequest(context=args.context, batch=args.batch, device=card,
                                    gpu_memory_utilization=args.gpu_memory_utilization))
    if result["cache_budget_bytes"] <= 0:
        raise PlanError(f"{spec.name}'s weights leave no cache room on {card.name}")
    return result["cache_budget_bytes"]


def run(args: argparse.Namespace) -> int:
    from kvlab.report.chart_data import chart_data
    from kvlab.report.chart_page import render_chart_html

    kv_heads = args.kv_heads
    args.kv_heads = None  # on the page the KV-head count is a control, not a rewrite of the model
    spec = model_from_args(args)
    if kv_heads is not None and (kv_heads > spec.q_heads or spec.q_heads % kv_heads):
        raise PlanError(f"--kv-heads {kv_heads} must divide the {spec.q_heads} query heads")
    data = chart_data(spec, args.context, args.batch, _budget(args, spec), kv_heads, args.bits)
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(render_chart_html(data))
    print(f"wrote {os.path.abspath(args.out)}", file=sys.stderr)
    if args.png:
        from kvlab.report.chart_png import write_chart_png
        write_chart_png(data, args.png)
        print(f"wrote {os.path.abspath(args.png)}", file=sys.stderr)
    return 0
