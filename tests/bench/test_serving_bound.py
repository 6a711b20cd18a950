"""The serving target's ceiling: the C step's measured costs and the schedule arithmetic built on them."""

import sys
from pathlib import Path

import pytest

from needs import require_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
from test_c_model import GQA, ggml_model  # noqa: E402  (a random model of GGML blocks: the C step runs it)

COSTS = {"requests": 16, "input_len": 128, "output_len": 24,
         "prefill_ms_per_token": {"1": 1.5, "16": 1.25}, "decode_step_ms": {"1": 8.0, "4": 12.0, "5": 14.0, "16": 32.0}}


def test_each_seat_count_runs_the_prefill_then_its_waves_of_decode_steps():
    from kvlab.bench.serving_bound import schedule_bounds

    bounds = {b["seats"]: b for b in schedule_bounds(COSTS, tpot_limit_ms=13.0)}
    assert sorted(bounds) == [1, 4, 5, 16]
    prefill_s = 16 * 128 * 1.25 / 1e3  # 2.56 s: every prompt token at the one-call rate
    assert bounds[4]["prefill_s"] == prefill_s
    assert bounds[4]["duration_s"] == pytest.approx(prefill_s + 4 * 23 * 12.0 / 1e3)  # 4 waves of 23 steps
    assert bounds[5]["duration_s"] == pytest.approx(prefill_s + 4 * 23 * 14.0 / 1e3)  # ceil(16 / 5) = 4 waves too
    assert bounds[16]["output_throughput"] == pytest.approx(384 / (prefill_s + 23 * 32.0 / 1e3))
    assert [bounds[s]["within_tpot"] for s in (1, 4, 5, 16)] == [True, True, False, False]
    assert schedule_bounds(COSTS)[0]["within_tpot"] is None  # no limit given


def test_seat_counts_beyond_the_requests_are_left_out():
    from kvlab.bench.serving_bound import schedule_bounds

    assert [b["seats"] for b in schedule_bounds({**COSTS, "requests": 4, "prefill_ms_per_token": {"4": 1.3}})] == [1, 4]


def test_the_fastest_run_within_the_limit_and_the_prefill_it_would_need():
    from kvlab.bench.serving_bound import best_within, prefill_needed_ms, schedule_bounds

    bounds = schedule_bounds(COSTS, tpot_limit_ms=13.0)
    best = best_within(bounds)
    assert best["seats"] == 4
    goal = 1.2 * best["output_throughput"]
    needed = prefill_needed_ms(COSTS, best, goal)
    faster = {**COSTS, "prefill_ms_per_token": {**COSTS["prefill_ms_per_token"], "16": needed}}
    rerun = {b["seats"]: b for b in schedule_bounds(faster, 13.0)}[4]
    assert rerun["output_throughput"] == pytest.approx(goal)  # that prefill gives exactly the goal
    assert prefill_needed_ms(COSTS, best, 384 / (4 * 23 * 12.0 / 1e3)) is None  # decode alone fills the time
    assert best_within(schedule_bounds(COSTS, tpot_limit_ms=5.0)) is None


def test_costs_come_from_the_engines_own_c_step():
    require_kernels()
    from kvlab.bench.serving_bound import measure_costs

    costs = measure_costs(ggml_model(GQA), None, requests=3, input_len=8, output_len=4, kv_cache_dtype="auto",
                          rows=(1, 2), repetitions=1)
    assert set(costs["prefill_ms_per_token"]) == {"1", "3"} and set(costs["decode_step_ms"]) == {"1", "2"}
    assert set(costs["decode_layers_ms"]) == set(costs["greedy_pick_ms"]) == {"1", "2"}
    assert all(v > 0 for v in [*costs["prefill_ms_per_token"].values(), *costs["decode_step_ms"].values(),
                               *costs["decode_layers_ms"].values(), *costs["greedy_pick_ms"].values()])
    assert costs["decode_position"] == 10


def test_a_model_of_several_kv_groups_is_measured_with_blocks_in_each():
    """Gemma 3's sliding and global layers sit in KV groups of one pool: each sequence needs its own
    blocks in every group (one table for all of them wrote outside the pool, and the command stopped)."""
    require_kernels()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nn"))
    from test_paged_decode_gemma import gemma_model

    from kvlab.bench.serving_bound import workload_steps

    engine, calls = workload_steps(gemma_model(), None, requests=3, input_len=24, output_len=8,
                                   kv_cache_dtype="auto", rows=(1, 3))
    assert len(engine.pool.groups) > 1
    assert calls[("decode", 3)]().shape == (3, 96)
    assert calls[("pick", 3)]() == calls[("decode", 3)]().argmax(dim=-1).tolist()
    calls[("layers", 3)]()  # no row's scores: the LM head skipped


def test_a_model_without_the_c_step_has_no_costs():
    from kvlab.bench.serving_bound import measure_costs
    from kvlab.nn.model import Decoder

    assert measure_costs(Decoder(GQA), None) == {}


def test_bad_sizes_are_one_line_errors(capsys):
    from kvlab.cli import main

    assert main(["bench", "serving-bound", "--output-len", "1"]) == 2
    assert "--output-len is too small: 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serving-bound", "--requests", "0"])
    assert exit_.value.code == 2 and "expected a positive integer" in capsys.readouterr().err
