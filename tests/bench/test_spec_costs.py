"""The step costs behind the speculative report: measured on the engine's own C steps, reported as ratios."""

import sys
from pathlib import Path

import pytest

from needs import require_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_c_model import GQA, ggml_model  # noqa: E402  (a random model of GGML blocks: the C step runs it)


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


def test_two_measurements_combine_into_their_means_and_keep_both():
    from kvlab.bench.spec_costs import combine_costs

    before = {"context": 60, "repetitions": 7, "iterations": 8, "plain_step_ms": 10.0,
              "verify_cost": {"1": 1.0, "2": 1.2}, "draft_cost": {"draft-xs": 0.1}}
    after = {**before, "plain_step_ms": 12.0, "verify_cost": {"1": 1.0, "2": 1.4}, "draft_cost": {"draft-xs": 0.2}}
    both = combine_costs([before, {}, after])  # a model without the C step measures nothing: skipped
    assert both["plain_step_ms"] == 11.0 and both["verify_cost"] == {"1": 1.0, "2": pytest.approx(1.3)}
    assert both["draft_cost"] == {"draft-xs": pytest.approx(0.15)} and both["runs"] == [before, after]
    assert combine_costs([{}, {}]) == {}
