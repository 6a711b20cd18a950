"""`kvlab study gqa`: train, measure and report the MHA/GQA/MQA/MLA study (see kvlab.studies.gqa)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kvlab.commands.args import comma_list, positive_int

GQA_HELP = "train MHA, GQA, MQA and MLA character models; measure quality, cache bytes, speed; uptrain"
GQA_EXAMPLES = """examples:
  kvlab study gqa                      # the default study (about an hour on 2 CPU cores) -> reports/gqa-study
  kvlab study gqa --quick              # a minute or two: checks the pipeline end to end, not the science
  kvlab study gqa --preset seed        # the issue's size (6 layers, 256 wide, 256 context): for bigger machines
  kvlab study gqa --data input.txt --seeds 0,1,2 --steps 2000 --out /tmp/gqa

A killed study rerun with the same settings resumes from its checkpoints (in --work).
"""


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(run=lambda args: _no_study(parser))
    studies = parser.add_subparsers(dest="study", metavar="STUDY")
    gqa = studies.add_parser("gqa", help=GQA_HELP, description=GQA_HELP, epilog=GQA_EXAMPLES,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    gqa.add_argument("--quick", action="store_true", help="tiny models and few steps (the test suite's check)")
    gqa.add_argument("--preset", choices=("default", "seed"), default="default",
                     help="model size and budget: default (fits an hour on 2 cores) or seed (6x8x256, ctx 256)")
    gqa.add_argument("--data", metavar="PATH", help="training text (default: Tiny Shakespeare, cached in "
                                                    "~/.cache/kvlab or downloaded and checked by sha256)")
    gqa.add_argument("--out", metavar="DIR", help="report folder: results.json, README.md, figures "
                                                  "(default: reports/gqa-study; with --quick, inside --work)")
    gqa.add_argument("--work", metavar="DIR", help="checkpoints and stage results (default: ~/.cache/kvlab/studies)")
    gqa.add_argument("--seeds", type=comma_list, default=["0", "1"], help="comma-separated seeds (0,1)")
    gqa.add_argument("--steps", type=positive_int, help="training steps per run (default: the preset's)")
    gqa.add_argument("--threads", type=positive_int, help="torch threads (default: the preset's; 1 for default "
                                                           "and quick, which is steadier on a shared machine)")
    gqa.add_argument("--json", action="store_true", help="print results.json to stdout instead of a table")
    gqa.add_argument("--render-only", action="store_true",
                     help="only redraw README.md and figures from --out's results.json (e.g. after editing "
                          "its discussion.md); trains and measures nothing")
    gqa.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    gqa.set_defaults(run=run)


def _no_study(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from kvlab.plan.errors import PlanError
    from kvlab.studies.gqa import StudyOptions, run_study
    from kvlab.studies.gqa_config import PRESETS

    try:
        seeds = tuple(int(s) for s in args.seeds)
    except ValueError:
        raise PlanError(f"--seeds must be integers, got {','.join(args.seeds)}") from None
    if len(set(seeds)) != len(seeds):
        raise PlanError(f"--seeds repeats a seed: {','.join(args.seeds)}")
    preset = PRESETS["quick" if args.quick else args.preset]
    if args.steps:
        preset = replace(preset, steps=args.steps)
    if args.threads:
        preset = replace(preset, threads=args.threads)
    out = Path(args.out) if args.out else (None if args.quick else Path("reports") / "gqa-study")
    if args.render_only:
        return render_only(out)
    command = " ".join(["kvlab", "study", "gqa"] + _flags(args))
    options = StudyOptions(preset=preset, seeds=seeds, data=args.data, out=out,
                           work=Path(args.work) if args.work else None, progress=not args.no_progress,
                           command=command)
    results = run_study(options)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_summary(results)
    return 0


def render_only(out) -> int:
    from kvlab.plan.errors import PlanError
    from kvlab.nn.config import plan_spec
    from kvlab.report.gqa_report import write_report
    from kvlab.files import read_json

    if out is None:
        raise PlanError("--render-only needs --out DIR (the folder holding results.json)")
    results = read_json(out / "results.json")
    if results is None:
        raise PlanError(f"--render-only: no results.json in {out}")
    print(f"wrote {write_report(results, out, plan_spec)}", file=sys.stderr)
    return 0


def _flags(args: argparse.Namespace) -> list[str]:
    flags = ["--quick"] if args.quick else ([] if args.preset == "default" else ["--preset", args.preset])
    if args.data:
        flags += ["--data", args.data]
    if args.out:
        flags += ["--out", args.out]
    if args.seeds != ["0", "1"]:
        flags += ["--seeds", ",".join(args.seeds)]
    if args.steps:
        flags += ["--steps", str(args.steps)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    return flags


def print_summary(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GQA study ({results['preset']['name']}): {results['provenance']['wall_seconds'] / 60:.1f} min")
    decode = results["decode"]  # measured once per variant (seed 0's weights), not per seed
    batches = sorted({b for cells in decode.values() for b in cells}, key=int)
    for column in ["variant", "KV heads", "val loss (mean ± std)", "KV bytes/token"] + \
            [f"decode tok/s b{b}" for b in batches] + ["train tok/s"]:
        table.add_column(column, justify="left" if column == "variant" else "right")
    per_token = {v["variant"]: v["kv_bytes_per_token"] for v in results["variants"]}
    for name, item in results["summary"].items():
        speeds = [decode.get(name, {}).get(b, {}).get("tokens_per_s_median") for b in batches]
        table.add_row(name, str(item["kv_heads"] or "latent"), f"{item['val_loss_mean']:.4f} ± {item['val_loss_std']:.4f}",
                      f"{per_token[name]:,}", *["" if s is None else f"{s:,.0f}" for s in speeds],
                      f"{item['train_tokens_per_s_mean']:,.0f}")
    console = Console()
    console.print(table)
    up = Table(title="uptraining from MHA")
    for column in ("method", "KV heads", "before", "after", "steps"):
        up.add_column(column, justify="right")
    for r in results["uptraining"]:
        up.add_row(r["method"], str(r["kv_heads"]), f"{r['val_loss_before']:.4f}", f"{r['val_loss_after']:.4f}",
                   str(r["steps"]))
    console.print(up)
    print(f"report: {results['provenance']['report_folder']} (README.md, results.json, figures)", file=sys.stderr)
