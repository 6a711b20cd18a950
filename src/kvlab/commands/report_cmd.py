"""`kvlab report NAME [PATH]`: re-render a committed report's page from its JSON alone, measuring nothing.

Every page under reports/ is written by the benchmark that measures it (`kvlab bench ...`); this
command rewrites one from the JSON already there, so a change of wording or layout is checked
against the same figures (tests/report/test_committed_reports.py renders each and compares).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# name -> (default path: the report folder, or for vllm-conversions its JSON; what it renders)
REPORTS = {
    "real-models": ("reports/real-models", "README.md from serving.json, engine_throughput.json, uptrain.json, notes.md"),
    "conversions": ("reports/conversions", "README.md from results.json"),
    "serving": ("reports/serving", "README.md from every JSON file there"),
    "startup": ("reports/startup", "README.md from every JSON file there and notes.md"),
    "decode-speed": ("reports/decode_speed", "README.md from its JSON files and notes.md"),
    "speculative": ("reports/speculative", "README.md from results.json"),
    "eagle": ("reports/speculative/eagle", "README.md from results.json"),
    "vllm-conversions": ("reports/real-models/conversions.json", "the .md beside the JSON"),
    "mla-convert": ("reports/mla-convert", "README.md from every MODEL.json there"),
    "fleet": ("reports/fleet", "README.md from its JSON files and notes.md"),
}


def add_parser(subparsers, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(run=lambda args: parser.error(f"choose a report: {', '.join(REPORTS)}"))
    reports = parser.add_subparsers(dest="report", metavar="REPORT")
    for report, (default, what) in REPORTS.items():
        text = f"re-render {default}: {what}"
        sub = reports.add_parser(report, help=text, description=text)
        sub.add_argument("path", nargs="?", type=Path, default=Path(default), help=f"(default {default})")
        sub.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> int:
    path = render(args.report, args.path)
    print(f"wrote {path}")
    return 0


def render(report: str, path: Path) -> Path:
    """Write `report`'s page from the JSON at `path`; the page's path."""
    from kvlab.errors import KvlabError
    from kvlab.files import write_atomic

    if not path.exists():
        raise KvlabError(f"no {path}: give the report's folder (or for vllm-conversions its JSON)")
    if report == "real-models":
        from kvlab.report.real_models import render as real_models
        return real_models(path)
    if report == "conversions":
        from kvlab.report.conversions import write
        return write(path)
    if report in ("serving", "startup", "decode-speed"):
        from kvlab.report import decode_speed_report, serving_report, startup_report
        module = {"serving": serving_report, "startup": startup_report, "decode-speed": decode_speed_report}[report]
        return module.write(path)
    if report in ("mla-convert", "fleet"):
        from kvlab.report import fleet, mla_convert
        return (mla_convert if report == "mla-convert" else fleet).write(path)
    if report in ("speculative", "eagle"):
        from kvlab.report import eagle, speculative
        page = (speculative if report == "speculative" else eagle).render(_json(path / "results.json"))
        return write_atomic(path / "README.md", page)
    from kvlab.report.vllm_conversions import render as vllm_conversions
    return write_atomic(path.with_suffix(".md"), vllm_conversions(_json(path)))


def _json(path: Path) -> dict:
    from kvlab.errors import KvlabError
    if not path.is_file():
        raise KvlabError(f"no {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise KvlabError(f"{path} is not JSON: {error}") from None
