"""reports/startup/README.md, written from kvlab.bench.startup's JSON files and nothing else.

    kvlab report startup [reports/startup]

Every *.json in the folder is one run of the benchmark (trees compared, medians, samples,
provenance); the page lists each as a table, so no figure is typed by hand. Hand-written
remarks live in notes.md beside them and are appended as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlab.files import write_atomic
from kvlab.report.markdown import table

LABELS = {
    "plan_file": "`kvlab plan FILE.gguf` to exit",
    "plan_name": "`kvlab plan smollm2-135m` to exit",
    "engine": "process start to `LLMEngine` ready",
    "engine_imports": "of which imports (torch's included)",
    "engine_load": "of which `load_for_engine` + `LLMEngine`",
    "serve_health": "`kvlab serve` to first 200 on /health",
    "serve_first_completion": "that server's first 1-token completion",
}


def _section(name: str, result: dict) -> list[str]:
    labels = list(result["trees"])
    prov = result["provenance"]
    trees = ", ".join(f"{label} = {tree['src']} at {(tree['git_commit'] or 'unknown')[:7]}"
                      for label, tree in result["trees"].items())
    lines = [f"## {name}", "",
             f"{result['runs']} cold runs each after {result['warmup']} warm-up round(s), medians in seconds; "
             f"{trees}; bytecode {result['bytecode']}; `{result['kvlab_executable']}`; "
             f"{prov['time_utc']}, {prov['machine']['cpu']} ({prov['machine']['cores']} cores), "
             f"torch {prov['torch_version']}, Python {prov['python_version']}.", ""]
    ratio = len(labels) > 1
    rows = []
    for measure, figures in result["results"].items():  # older runs lack some measures: rows for those they have
        medians = figures["median_s"]
        rows.append([LABELS.get(measure, measure), *(f"{medians[label]:.3f}" for label in labels)]
                    + ([f"{medians[labels[-1]] / medians[labels[0]]:.2f}"] if ratio else []))
    lines += table(["figure", *labels] + ([f"{labels[-1]} / {labels[0]}"] if ratio else []), rows)
    lines.append("")
    return lines


def render(folder: Path) -> str:
    lines = ["# Cold start-up: plan, engine, serve (SmolLM2-135M-Instruct, Q4_1 GGUF)", "",
             "<!-- Written by `kvlab report startup` from the JSON files here; edit notes.md. -->", "",
             "Regenerate (a few minutes; the second run measures with bytecode cached, as an install has it):", "",
             "```bash",
             "flock /tmp/kvlab-heavy.lock kvlab bench startup --tree main=/work/main/src --tree branch=src \\",
             "    --runs 5 --json-out reports/startup/startup.json",
             "flock /tmp/kvlab-heavy.lock kvlab bench startup --tree main=/work/main/src --tree branch=src \\",
             "    --runs 5 --pycache /tmp/kvlab-pycache --json-out reports/startup/startup_bytecode.json",
             "kvlab report startup reports/startup",
             "```", "",
             "Each figure is a fresh process (Python and torch start from nothing; the GGUF is in the OS "
             "page cache); the trees take turns within every round, so ratios come from one run.", ""]
    for path in sorted(folder.glob("*.json")):
        lines += _section(path.stem, json.loads(path.read_text()))
    notes = folder / "notes.md"
    if notes.is_file():
        lines += [notes.read_text().rstrip(), ""]
    return "\n".join(lines)


def write(folder: Path) -> Path:
    """README.md in `folder`, rendered from the JSON there and written atomically."""
    return write_atomic(folder / "README.md", render(folder))
