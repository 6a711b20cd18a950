"""The speculative report's contrasts are computed from the runs, on matched pairs only."""

from kvlab.bench.speculative_report import contrasts


def cell(workload, batch, temperature, runs):
    return {"workload": workload, "batch": batch, "temperature": temperature,
            "runs": [{"method": m, "k": k, "acceptance_rate": a} for m, k, a in runs]}


def test_contrasts_average_matched_runs_and_ignore_unmatched():
    cells = [cell("chat", 1, 0.0, [("ngram", 3, 0.4), ("ngram", 5, 0.9)]),
             cell("predictable", 1, 0.0, [("ngram", 3, 0.6)]),
             cell("chat", 1, 0.7, [("ngram", 3, 0.2)])]
    (line,) = contrasts(cells)
    assert "chat -> predictable: mean acceptance 0.400 -> 0.600 over 1 matched runs" in line
    assert "temperature 0 -> 0.7: mean acceptance 0.400 -> 0.200 over 1 matched runs" in line
    assert contrasts([cell("chat", 1, 0.0, [("ngram", 3, 0.4)])]) == []
