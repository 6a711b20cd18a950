"""The speculative report's contrasts are computed from the runs, on matched pairs only; the committed report
renders byte for byte from its results.json."""

from kvlab.report.speculative import contrasts


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


def test_cost_model_holds_each_run_against_the_measured_costs():
    from kvlab.report.speculative import cost_model

    costs = {"context": 300, "repetitions": 7, "plain_step_ms": 10.0, "step_ms": {},
             "verify_cost": {"1": 1.0, "2": 1.2, "3": 1.4, "4": 1.6, "5": 1.8}, "draft_cost": {"draft-xs": 0.2}}
    runs = [{"method": "ngram", "k": 2, "mean_acceptance_length": 2.1, "speedup": 1.3, "num_drafts": 10,
             "decode_tokens": 42},
            {"method": "draft-xs", "k": 1, "mean_acceptance_length": 1.5, "speedup": 1.0, "num_drafts": 20,
             "decode_tokens": 30},
            {"method": "ngram", "k": 4, "mean_acceptance_length": 2.0, "speedup": 1.1, "num_drafts": 0,
             "decode_tokens": 40},
            {"method": "self-6", "k": 2, "mean_acceptance_length": 1.1, "speedup": 0.5, "num_drafts": 5,
             "decode_tokens": 6}]  # no cost measured: left out
    text = "\n".join(cost_model(costs, {"runs": runs}))
    # ngram k = 2: cost 1.4 (three rows), its drafting steps pay 2.1 / 1.4 = 1.5x and emit 21 of 42 tokens:
    # 42 / (21 plain steps + 10 x 1.4) = 1.2x over the answer; 1.5 x 1.4 = 2.1 tokens needed
    assert "| ngram | 2 | 1.40 | 2.10 | 1.50x | 50% | 1.20x | 1.30x | 2.10 |" in text
    # draft-xs k = 1: one round at 0.2 and two rows at 1.2 cost 1.4: 2.1 tokens needed, over k + 1 = 2
    assert "| draft-xs | 1 | 1.40 | 1.50 | 1.07x | 100% | 1.07x | 1.00x | 2.10 (over k + 1: out of reach) | - |" in text
    # ngram k = 4 that never matched: all plain steps, predicted 1x; 2.7 tokens needed, within 5
    from kvlab.plan.speculative import acceptance_needed
    assert (f"| ngram | 4 | 1.80 | 2.00 | 1.11x | 0% | 1.00x | 1.10x | 2.70 | "
            f"{acceptance_needed(1.5, 4, 0.0, 1.8):.2f} |") in text
    assert "self-6" not in text
