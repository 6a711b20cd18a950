"""The serving report's section on vLLM's request fields, rendered from its JSON alone."""

from __future__ import annotations

import json

from kvlab.bench.compare import ratios
from kvlab.bench.lm_eval_compare import compare
from kvlab.report.serving_report import render

PROV = {"git_commit": "abcdef1234", "git_dirty_files": [], "time_utc": "2026-12-01T12:00:00Z",
        "machine": {"cpu": "CPU", "cores": 2, "torch_threads": 2}}


def _server(lls, answers, acc=0.5):
    return {"command": "x", "startup_s": 1.0, "seconds": 10.0, "cloze_acc": acc, "passkey_exact_match": 1.0,
            "cloze_loglikelihoods": lls, "cloze_correct": [True], "passkey_answers": answers,
            "passkey_correct": [True], "lm_eval_command": "lm_eval --model local-completions ..."}


def test_lm_eval_pairs_give_the_largest_per_item_difference(tmp_path):
    a = _server([[-1.0, -2.0], [-3.0, -0.5]], ["123"])
    b = _server([[-1.00002, -2.0], [-0.4, -0.5]], ["124"])
    pair = compare(a, b)
    assert abs(pair["max_abs_loglikelihood_diff"] - 2.6) < 1e-12
    assert pair["cloze_choices_differing"] == 1 and pair["passkey_answers_differing"] == 1
    result = {"model": "m", "tasks": {"kvlab_novel_cloze": 2, "kvlab_passkey": 1}, "servers": {"kvlab": a, "vllm": b},
              "pairs": {"kvlab vs vllm": pair}, "provenance": PROV}
    (tmp_path / "lm_eval.json").write_text(json.dumps(result))
    page = render(tmp_path)
    assert "| kvlab vs vllm | 2.60e+00 |" in page and "| vllm | 0.500 | 1.000 | 10 |" in page
    assert "lm_eval run --model local-completions --model_args model=m,base_url=http://127.0.0.1:8000" in page


def test_structured_and_plain_sections_state_their_targets(tmp_path):
    structured = {"model": "m", "provenance": PROV,
                  "validity": {"answers": 100, "valid": 100, "concurrency": 16, "max_tokens": 256,
                               "finish_reasons": {"stop": 100, "length": 0}, "examples": ['{"a": 1}']},
                  "step_cost": {"rows": 16, "repeats": 3, "decode_steps_per_run": 32, "free_step_ms": [30.0],
                                "constrained_step_ms": [31.5], "free_median_ms": 30.0, "constrained_median_ms": 31.5,
                                "ratio": 1.05, "target_ratio": 1.10}}
    (tmp_path / "structured.json").write_text(json.dumps(structured))

    def run(tps, tpot):
        return {"input_len": 128, "max_concurrency": 16, "completed": 16, "failed": 0, "total_output_tokens": 1024,
                "requested_output_tokens": 1024, "output_throughput": tps, "mean_tpot_ms": tpot}
    peers = [{"name": "kvlab", "status": "ran", "runs": [run(200.0, 40.0)]},
             {"name": "kvlab-before", "status": "ran", "runs": [run(198.0, 40.5)]}]
    (tmp_path / "compare_plain.json").write_text(json.dumps(
        {"peers": peers, "cells": ratios(peers, [(128, 16)]), "provenance": PROV}))
    page = render(tmp_path)
    assert "100 of 100 answers parse and validate against their schema (target 100%: met)" in page
    assert "**1.050x** (target at most 1.10x: met)" in page
    assert "| 128 | 16 | 200.0 | 198.0 | 1.010x | 40.0 / 40.5 |" in page
