"""The fleet's parts: workloads as the bench draws them, the replica's pool from the plan, the step
costs and their fit, the cost arithmetic, and the SLO search."""

import json
import math

import numpy as np
import pytest
from fleet_helpers import replica, requests

from kvlab.bench.serve_client import arrival_offsets
from kvlab.fleet.calibrate import fit
from kvlab.fleet.errors import FleetError
from kvlab.fleet.fleet import simulate
from kvlab.fleet.results import summarise
from kvlab.fleet.service import load_calibration, replica_from_plan, weights_fit_tp
from kvlab.fleet.sizing import smallest_fleet
from kvlab.fleet.step_cost import LinearCost, RooflineCost, chunk_pairs
from kvlab.fleet.workload import LengthDist, Workload, arrival_times, draw
from kvlab.plan.capacity import cache_formats, kv_bytes_per_token
from kvlab.plan.hardware import device
from kvlab.plan.planner import PlanRequest, plan
from kvlab.plan.presets import preset


@pytest.mark.parametrize("rate,burstiness", [(3.0, 1.0), (50.0, 0.5), (7.0, math.inf)])
def test_arrivals_are_the_benchmarks_own(rate, burstiness):
    """Same seed, same offsets as `kvlab bench serve`: the validation compares like with like."""
    np.testing.assert_array_equal(arrival_times(500, rate, burstiness, 9), arrival_offsets(500, rate, burstiness, 9))


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert (LengthDist.parse("512").sample(rng, 10) == 512).all()
    u = LengthDist.parse("uniform:100:0.5").sample(rng, 20000)
    assert u.min() == 50 and u.max() == 150
    lg = LengthDist.parse("lognormal:300:0.8").sample(rng, 200000)
    assert lg.mean() == pytest.approx(300, rel=0.02) and lg.min() >= 1
    for bad in ("uniform:100:1.5", "gamma:3", "x", "0"):
        with pytest.raises(FleetError):
            LengthDist.parse(bad)


def test_shared_prefix_fraction_and_trace(tmp_path):
    reqs = draw(Workload(5.0, 4000, LengthDist.parse("32"), LengthDist.parse("8"), prefix_fraction=0.25,
                         prefix_len=100, num_prefixes=2))
    shared = reqs.prefix_id >= 0
    assert shared.mean() == pytest.approx(0.25, abs=0.02)
    assert set(reqs.prefix_id[shared]) == {0, 1}
    assert (reqs.prompt_len[shared] == 132).all() and (reqs.prompt_len[~shared] == 32).all()
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival": 2.0, "prompt_len": 10, "output_len": 3}\n'
                     '{"arrival": 1.0, "prompt_len": 20, "output_len": 4, "prefix_id": 0, "prefix_len": 16}\n')
    t = draw(Workload(1.0, 1, LengthDist.parse("1"), LengthDist.parse("1"), trace=str(trace)))
    assert t.arrival.tolist() == [1.0, 2.0] and t.prompt_len.tolist() == [20, 10] and t.prefix_id.tolist() == [0, -1]
    trace.write_text('{"arrival": 1.0, "prompt_len": 0, "output_len": 4}\n')
    with pytest.raises(FleetError):
        draw(Workload(1.0, 1, LengthDist.parse("1"), LengthDist.parse("1"), trace=str(trace)))


@pytest.mark.parametrize("model,card,dtype,kv_heads", [("llama-3-8b", "h100", "fp16", None),
                                                       ("llama-3-70b", "h100", "fp8", None),
                                                       ("llama-3-70b", "h100", "fp16", 64),
                                                       ("smollm2-135m", "orin", "auto", None)])
def test_the_replicas_pool_is_the_plans_bytes(model, card, dtype, kv_heads):
    """Blocks x block_size x the plan's bytes per token never exceed the plan's budget per card."""
    spec = preset(model) if kv_heads is None else preset(model).with_kv_heads(kv_heads)
    request = PlanRequest(kv_cache_dtype=dtype, device=device(card))
    rep = replica_from_plan(spec, request, max_model_len=4608, block_size=16)
    check = plan(spec, PlanRequest(kv_cache_dtype=dtype, device=device(card), tensor_parallel=rep.cards))
    per_token = kv_bytes_per_token(spec, cache_formats(dtype), rep.cards)
    assert rep.kv_bytes_per_token == per_token == check["kv_bytes_per_token"]
    assert rep.num_blocks == check["kv_cache_tokens"] // 16
    assert rep.num_blocks * 16 * per_token <= check["cache_budget_bytes"] < (rep.num_blocks + 1) * 16 * per_token
    assert rep.num_blocks * 16 >= 4608  # one longest request fits: the fewest cards were chosen for that
    if rep.cards > 1:
        smaller = plan(spec, PlanRequest(kv_cache_dtype=dtype, device=device(card), tensor_parallel=rep.cards // 2))
        assert smaller.get("cache_budget_bytes", 0) < 4608 * smaller["kv_bytes_per_token"]


def test_cards_for_llama_3_70b_weights():
    """141 GB of bf16 weights: two 80 GB cards at 0.9 leave ~3 GB for KV; fp8 KV fits one 4.6k request there."""
    spec = preset("llama-3-70b")
    assert weights_fit_tp(spec, PlanRequest(device=device("h100"), kv_cache_dtype="fp8"), 4608, 16) == 2
    assert weights_fit_tp(spec, PlanRequest(device=device("l4")), 4608, 16) == 8


def test_roofline_step_cost_arithmetic():
    cost = RooflineCost(weight_bytes_read=1e9, kv_bytes_per_token=1e5, flops_per_token=2e9,
                        attention_flops_per_pair=1e4, bandwidth_gbs=1000, tflops=100, bandwidth_efficiency=0.5,
                        compute_efficiency=0.5, step_overhead_s=0.001)
    # 4 decoders at 1,000 tokens: bytes 1e9 + 1e5 x 4,004 over 500 GB/s; FLOPs 8e9 + 1e4 x 4,004 over 50 TFLOP/s
    assert cost.seconds(4, 4000, 0, 0, 0) == pytest.approx(0.001 + (1e9 + 1e5 * 4004) / 5e11)
    # a 4,096-token prefill is compute bound
    pairs = chunk_pairs(0, 4096)
    assert pairs == 4096 * 4097 // 2
    assert cost.seconds(0, 0, 4096, pairs, 4096) == pytest.approx(0.001 + (2e9 * 4096 + 1e4 * pairs) / 5e13)
    assert cost.seconds(0, 0, 0, 0, 0) == 0.0


def test_fit_recovers_a_known_linear_cost(tmp_path):
    truth = LinearCost(0.004, 0.0008, 2e-7, 0.01, 0.0003, 3e-9)
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(40):
        b, ctx = int(rng.integers(1, 33)), int(rng.integers(10, 800))
        samples.append({"decode_seqs": b, "decode_ctx": b * ctx, "prefill_tokens": 0, "prefill_pairs": 0,
                        "seconds": truth.seconds(b, b * ctx, 0, 0, 0)})
        n = int(rng.integers(16, 1024))
        samples.append({"decode_seqs": 0, "decode_ctx": 0, "prefill_tokens": n, "prefill_pairs": chunk_pairs(0, n),
                        "seconds": truth.seconds(0, 0, n, chunk_pairs(0, n), n)})
    cost, quality = fit(samples)
    for name in ("decode_base", "decode_per_seq", "decode_per_ctx", "mixed_base", "mixed_per_token", "mixed_per_pair"):
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert quality["decode_median_abs_error"] < 1e-9
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"fit": cost.describe()}))
    assert load_calibration(str(path))[0] == cost
    path.write_text("{}")
    with pytest.raises(FleetError):
        load_calibration(str(path))


def test_cost_and_break_even_arithmetic():
    reqs = requests(rate=2.0, n=200, output="100")
    run = simulate(replica(), reqs, 3, "round-robin")
    s = summarise(run, cards_per_replica=2, slo={"ttft": 10_000, "tpot": 1_000}, price_per_card_hour=3.0,
                  price_per_mtok=0.5)
    hours = s["simulated_seconds"] / 3600
    assert s["cards"] == 6 and s["completed"] == 200
    assert s["cost"]["dedicated_per_mtok"] == pytest.approx(6 * 3.0 * hours / (200 * 100 / 1e6))
    # break-even: 6 cards x $3/h equals rate x 100 tokens x 3,600 s x $0.5 per million
    assert s["cost"]["break_even_rate"] == pytest.approx(18.0 / (100 * 3600 / 1e6 * 0.5))
    assert s["cost"]["cheaper"] == "pay-per-token"  # 2 req/s is far below the 1,000 req/s break-even
    assert s["meets_slo"] and s["goodput"] == pytest.approx(200 / s["simulated_seconds"])


def test_smallest_fleet_bisects_to_the_threshold():
    calls = []

    def meets(n):
        calls.append(n)
        return n >= 13, {"ttft_ms": {"p95": 1.0}, "tpot_ms": {"p95": 1.0}}

    n, _, trials = smallest_fleet(meets, start=4)
    assert n == 13 and 3 not in calls and len(calls) == len(set(calls))
    assert [t["replicas"] for t in trials] == sorted(calls)


def test_more_replicas_shorten_the_tail():
    reqs = requests(rate=30.0, n=600)
    p95 = [summarise(simulate(replica(max_num_seqs=32), reqs, n, "least-loaded"), 1)["ttft_ms"]["p95"]
           for n in (1, 2, 4)]
    assert p95[0] > p95[1] > p95[2]
