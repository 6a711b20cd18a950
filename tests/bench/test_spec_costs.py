"""The step costs behind the speculative report: measured on the engine's own C steps, reported as ratios."""

import sys
from pathlib import Path

import pytest

from needs import require_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_fused_decode import GQA, ggml_model  # noqa: E402  (a random model of GGML blocks: the C step runs it)


def test_costs_are_ratios_of_the_engines_own_steps():
    require_kernels()
    from kvlab.bench.spec_costs import measure_step_costs

    costs = measure_step_costs(ggml_model(GQA), None, {"self-1": {"method": "self", "num_layers": 1}},
                               context=40, max_rows=4, repetitions=2, iterations=2)
    assert costs["context"] == 40
    assert list(costs["verify_cost"]) == ["1", "2", "3", "4"]  # JSON's string keys, one per row count
    assert costs["verify_cost"]["1"] == 1.0
    assert costs["verify_cost"]["4"] == costs["step_ms"]["verify:4"] / costs["plain_step_ms"]
    assert set(costs["draft_cost"]) == {"self-1"}
    assert costs["draft_cost"]["self-1"] == costs["step_ms"]["draft:self-1"] / costs["plain_step_ms"] > 0


def test_a_model_without_the_c_step_has_no_costs():
    from kvlab.bench.spec_costs import measure_step_costs
    from kvlab.nn.model import Decoder

    assert measure_step_costs(Decoder(GQA), None, {}) == {}
