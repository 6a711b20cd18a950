"""The real-models tables' two engine columns, for either model: the engine's capacity line and its throughput.

Both models' tables end in these cells, read from serving.json's row (its `engine_capacity_line`) and from the
study's engine runs (kvlab.bench.real_models_throughput: a run's figures, or the engine's refusal).
"""

from __future__ import annotations

from typing import Optional


def cell(run: Optional[dict]) -> str:
    """One setting's engine run: output tok/s and, where it was not the C step, the path; the engine's one-line
    refusal where it does not serve the setting; '–' where it has not run."""
    if run is None:
        return "–"
    if "refused" in run:
        return f"not served: {run['refused']}"
    notes = [] if run["decode_path"] == "fused C step" else [run["decode_path"]]
    notes += ["dense weights"] if run.get("weights") == "dense" else []
    return f"{run['output_tokens_per_s']:.1f}" + (f" ({', '.join(notes)})" if notes else "")


def engine_cells(row: dict, runs: dict) -> list[str]:
    """The capacity cell ('Maximum concurrency ...', '–' where the engine refuses) and the throughput cell."""
    line = row.get("engine_capacity_line")
    return ["–" if line is None else line.split(": ", 1)[-1], cell(runs.get(row["label"]))]
