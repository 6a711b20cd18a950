"""`kvlab bench mla-quality`, `kvlab bench fleet-validate` and `kvlab bench fleet-report`: the MLA
conversion's quality grid and the fleet simulator's validation and worked examples.

The measurements live in kvlab.bench.mla_quality, kvlab.bench.fleet_validate and
kvlab.bench.fleet_report (JSON with provenance); the pages in kvlab.report.mla_convert and
kvlab.report.fleet, which `kvlab report mla-convert|fleet` re-render alone. This file holds the
parsers, and hands the fleet examples the `kvlab fleet` and `kvlab plan` parsers they run through.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from kvlab.commands.args import non_negative_int, positive_float, positive_int

MLA_QUALITY = ("what `kvlab convert --to mla` costs in perplexity per cached byte, at several ranks, without "
               "uptraining (reports/mla-convert/MODEL.json and its README)")
FLEET_VALIDATE = ("`kvlab fleet` against the real engine here: `kvlab bench serve` on `kvlab serve` at low, medium "
                  "and saturating load, against the simulator on the same requests (reports/fleet/validation.json)")
FLEET_REPORT = ("reports/fleet: the data-centre, speculative and edge examples of `kvlab fleet`, a day of traffic "
                "timed, and the README (reuses validation.json unless --validate)")


def grid_entries(text: str) -> list[tuple[str, int]]:
    """`full:8,24:8` -> [("full", 8), ("24", 8)]: RANK:ROPE_DIM, RANK a number or `full`."""
    grid = []
    for entry in filter(None, text.split(",")):
        rank, _, rope = entry.partition(":")
        if not rope.isdigit() or not (rank == "full" or rank.isdigit()):
            raise argparse.ArgumentTypeError(f"{entry!r} is not RANK:ROPE_DIM (RANK a number or `full`)")
        grid.append((rank, int(rope)))
    return grid


def positive_floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers such as 0.25,0.6,1.5, got {text!r}")
    return values


def kv_head_counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = [0]
    if values and min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected KV head counts such as 2,1, got {text!r}")
    return values


def add_parsers(benches) -> None:
    p = benches.add_parser("mla-quality", help=MLA_QUALITY, description=MLA_QUALITY)
    p.add_argument("model", nargs="?", help="the source model (stories260k, smollm2-135m, ...); without it, only "
                   "the README is re-rendered")
    p.add_argument("--grid", type=grid_entries, default=[],
                   help="conversions to score, RANK:ROPE_DIM,... (RANK may be `full`), e.g. full:8,24:8,full:4")
    p.add_argument("--kv-heads", type=kv_head_counts, default=[],
                   help="also the mean-pooled GQA conversions to these KV head counts (a reference of equal cache)")
    p.add_argument("--text", type=Path, help="scored text (default the shared data/english/frankenstein.txt)")
    p.add_argument("--context", type=positive_int, default=512, help="tokens per window (default 512)")
    p.add_argument("--windows", type=positive_int, default=4, help="windows scored (default 4)")
    p.add_argument("--offset", type=non_negative_int, default=1000, help="tokens of the text skipped (default 1000)")
    p.add_argument("--chunk", type=positive_int, default=128, help="tokens fed per forward (default 128)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
    p.add_argument("--out", type=Path, default=Path("reports/mla-convert"),
                   help="report folder: MODEL.json and README.md (default reports/mla-convert)")
    p.add_argument("--render", action="store_true",
                   help="(kept for the old script's users) the README is always re-rendered; = kvlab report mla-convert")
    p.set_defaults(run=run_mla_quality)

    p = benches.add_parser("fleet-validate", help=FLEET_VALIDATE, description=FLEET_VALIDATE)
    p.add_argument("--model", default="smollm2-135m", help="model served and simulated (default smollm2-135m)")
    p.add_argument("--calibration", default="reports/fleet/calibration-smollm2.json",
                   help="`kvlab fleet calibrate` output (default reports/fleet/calibration-smollm2.json)")
    p.add_argument("--out", default="reports/fleet/validation.json",
                   help="the JSON written (default reports/fleet/validation.json)")
    p.add_argument("--loads", type=positive_floats, default=[0.25, 0.6, 1.5],
                   help="low,medium,saturating rates as fractions of the simulated capacity (default 0.25,0.6,1.5)")
    p.add_argument("--seconds", type=positive_float, default=60.0, help="seconds of arrivals per workload (60)")
    p.add_argument("--min-prompts", type=positive_int, default=24, help="fewest requests per workload (default 24)")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and arrivals (default 0)")
    p.set_defaults(run=run_fleet_validate)

    p = benches.add_parser("fleet-report", help=FLEET_REPORT, description=FLEET_REPORT)
    p.add_argument("--out", type=Path, default=Path("reports/fleet"), help="report folder (default reports/fleet)")
    p.add_argument("--validate", action="store_true",
                   help="first re-measure: kvlab fleet calibrate, then kvlab bench fleet-validate")
    p.add_argument("--render", action="store_true", help="only rewrite README.md from the JSON files "
                   "(= kvlab report fleet)")
    p.add_argument("--skip-day", action="store_true", help="keep day.json (the longest part)")
    p.add_argument("--day-only", action="store_true", help="only the day-long speed run, then the README")
    p.add_argument("--speculative-only", action="store_true",
                   help="only the speculative-decoding example (about two minutes), then the README")
    p.set_defaults(run=run_fleet_report)


def run_mla_quality(args: argparse.Namespace) -> int:
    from kvlab.report.mla_convert import write

    if args.model:
        from kvlab.bench.mla_quality import measure
        from kvlab.commands.eval_cmd import default_text
        from kvlab.files import write_json

        result = measure(args.model, args.grid, args.kv_heads, args.text or default_text(), args.context,
                         args.windows, args.offset, args.chunk, args.threads)
        result["command"] = "kvlab " + " ".join(getattr(args, "argv", []) or ["bench", "mla-quality", args.model])
        write_json(args.out / f"{args.model}.json", result)
    elif not args.out.is_dir():
        from kvlab.errors import KvlabError
        raise KvlabError(f"no {args.out}: give a MODEL to measure, or --out the report folder")
    print(f"wrote {write(args.out)}")
    return 0


def run_fleet_validate(args: argparse.Namespace) -> int:
    from kvlab.errors import KvlabError
    from kvlab.files import write_json

    if not Path(args.calibration).is_file():
        raise KvlabError(f"no {args.calibration}: run `kvlab fleet calibrate {args.model} --output "
                         f"{args.calibration}` first")
    from kvlab.bench.fleet_validate import validate
    write_json(args.out, validate(args.model, args.calibration, args.loads, args.seconds, args.min_prompts, args.seed))
    print(f"wrote {args.out}")
    return 0


def run_fleet_report(args: argparse.Namespace) -> int:
    from kvlab.report.fleet import write

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.validate:
        from kvlab.bench.fleet_validate import child_env
        calibration = str(out / "calibration-smollm2.json")
        subprocess.run([sys.executable, "-m", "kvlab.cli", "fleet", "calibrate", "smollm2-135m", "--kv-cache-memory",
                        "1GiB", "--output", calibration], check=True, env=child_env())
        subprocess.run([sys.executable, "-m", "kvlab.cli", "bench", "fleet-validate", "--calibration", calibration,
                        "--out", str(out / "validation.json")], check=True, env=child_env())
    if not args.render:
        from kvlab.bench.fleet_examples import DRAFT
        from kvlab.bench.fleet_report import FleetExamples
        from kvlab.errors import KvlabError

        if not Path(DRAFT).is_dir():
            raise KvlabError(f"no {DRAFT}: run from the repository root (the examples name its draft config)")
        examples = FleetExamples(out, fleet_scenario, plan_result)
        if args.day_only:
            examples.day()
        elif args.speculative_only:
            examples.speculative()
        else:
            examples.datacentre()
            examples.speculative()
            examples.edge()
            if not args.skip_day:
                examples.day()
    print(f"wrote {write(out)}")
    return 0


def _parsed(module, name: str, argv: list[str]) -> argparse.Namespace:
    """`kvlab NAME ARGV` parsed by that command's own parser."""
    parser = argparse.ArgumentParser(prog="kvlab")
    module.add_parser(parser.add_subparsers(dest="command"), name, name)
    return parser.parse_args([name, *argv])


def fleet_scenario(argv: list[str]):
    """The Scenario `kvlab fleet ARGV` runs."""
    from kvlab.commands import fleet_cmd
    from kvlab.commands.fleet_scenario import scenario_from_args

    return scenario_from_args(_parsed(fleet_cmd, "fleet", argv))


def plan_result(argv: list[str]) -> dict:
    """The plan `kvlab plan ARGV` computes."""
    from kvlab.commands import plan_cmd
    from kvlab.commands.plan_args import model_from_args, request_from_args
    from kvlab.plan.planner import plan

    args = _parsed(plan_cmd, "plan", argv)
    return plan(model_from_args(args), request_from_args(args))
