"""`kvlab fleet --draft`: speculative decoding in both simulators, against the plan's pool and the paper's
tokens per step."""

import json
from dataclasses import replace

import numpy as np
import pytest
from fleet_helpers import calibration_file, replay, replica, requests

from kvlab.cli import main
from kvlab.fleet.fleet import simulate
from kvlab.fleet.outcomes import Outcomes
from kvlab.fleet.replica_engine import EngineReplica
from kvlab.fleet.replica_fast_spec import SpeculativeFastReplica
from kvlab.fleet.speculation import Speculation
from kvlab.fleet.step_cost import LinearCost
from kvlab.plan.speculative import expected_tokens_per_step

DRAFT_COST = LinearCost(decode_base=0.001, decode_per_seq=0.0001, decode_per_ctx=1e-7, mixed_base=0.002,
                        mixed_per_token=0.00002, mixed_per_pair=1e-9)


def speculative(a=0.7, k=3, seed=7, cost=DRAFT_COST, **kw):
    return replace(replica(**kw), speculation=Speculation("draft", a, k, cost, seed))


@pytest.mark.parametrize("simulator", ["engine", "fast"])
def test_acceptance_zero_is_plain_decoding_plus_the_drafts_cost(simulator):
    """a = 0: one token per step, so as many steps as without a draft; each step adds its draft rounds."""
    M, D, c, k, n = 0.020, 0.010, 0.003, 3, 10
    target = LinearCost(D, 0.0, 0.0, M, 0.0, 0.0)  # every step a constant: mixed M, pure decode D
    draft = LinearCost(c, 0.0, 0.0, c, 0.0, 0.0)  # every draft round c
    reqs = requests(n=1, prompt="32", output=str(n))
    plain = simulate(replica(cost=target), reqs, simulator=simulator).outcomes
    out = simulate(replace(replica(cost=target), speculation=Speculation("d", 0.0, k, draft)), reqs,
                   simulator=simulator).outcomes
    assert out.steps == plain.steps == n  # one prefill step, then n - 1 steps of one token each
    assert out.num_accepted_tokens == 0 and out.num_drafts == n - 2  # the last step has no room to draft
    # prefill: the target's chunk + the draft reading it; then each step verifies d = min(k, n - j - 1) drafts
    drafts = [min(k, n - j - 1) for j in range(1, n)]
    expected = (M + c) + sum(M + d * c if d else D for d in drafts)
    assert out.num_draft_tokens == sum(drafts)
    assert out.finish[0] - reqs.arrival[0] == pytest.approx(expected, rel=1e-12)
    assert out.first_token[0] - reqs.arrival[0] == pytest.approx(M + c, rel=1e-12)
    assert plain.finish[0] - reqs.arrival[0] == pytest.approx(M + (n - 1) * D, rel=1e-12)


@pytest.mark.parametrize("a,k", [(0.3, 2), (0.7, 4), (0.9, 3)])
def test_accepted_runs_follow_the_truncated_geometric(a, k):
    """min(G, k) + 1 over many (request, position) draws: mean within sampling error of (1 - a^(k+1)) / (1 - a)."""
    spec = Speculation("d", a, k, DRAFT_COST, seed=5)
    draws = np.array([min(k, spec.accepted_run(i, p)) for i in range(2000) for p in range(0, 100, 4)])
    emitted = draws + 1
    se = emitted.std(ddof=1) / np.sqrt(len(emitted))
    assert abs(emitted.mean() - expected_tokens_per_step(a, k)) < 4 * se
    for j in range(k):  # P(accepted run >= j + 1) = a^(j+1)
        assert abs((draws > j).mean() - a ** (j + 1)) < 4 * np.sqrt(a ** (j + 1) * (1 - a ** (j + 1)) / len(draws))


@pytest.mark.parametrize("simulator", ["engine", "fast"])
def test_simulated_tokens_per_step_match_the_closed_form(simulator):
    """Long answers (so nearly every verification has room for k drafts): the drawn mean is the paper's."""
    a, k = 0.6, 3
    reqs = requests(n=40, rate=2.0, prompt="64", output="600")
    run = simulate(speculative(a=a, k=k), reqs, simulator=simulator)
    out = run.outcomes
    emitted = 1 + out.num_accepted_tokens / out.num_drafts
    # std of emitted tokens per step is 1.17 here; the one or two short verifications at each answer's end bias it
    # by about -0.003
    assert emitted == pytest.approx(expected_tokens_per_step(a, k), abs=4 * 1.2 / np.sqrt(out.num_drafts) + 0.005)
    assert out.num_drafts > 5000


class CheckedEngine(EngineReplica):
    def step(self, limit=float("inf")):
        moved = super().step(limit)
        used = self.blocks.num_blocks - self.blocks.num_free
        held = {b for seq in self.scheduler.running for b in seq.block_table}
        assert used == len(held) <= self.spec.num_blocks
        for seq in self.scheduler.running:
            assert len(seq.output_ids) < seq.params.max_tokens  # never past max_tokens
            assert len(seq.block_table) == self.blocks.blocks_for(seq.num_computed) or not seq.num_computed
        return moved

    def check_finished(self):
        assert self.blocks.num_free == self.blocks.num_blocks
        assert all(block.ref_count == 0 for block in self.blocks.blocks)


class CheckedFast(SpeculativeFastReplica):
    def step(self):
        super().step()
        assert 0 <= self.free <= self.spec.num_blocks
        for s in self.running:
            assert s.outputs < s.target

    def _record(self, s, end):
        assert s.outputs == s.target  # exactly the requested output length
        super()._record(s, end)

    def check_finished(self):
        assert self.free == self.spec.num_blocks


@pytest.mark.parametrize("kind", [CheckedEngine, CheckedFast])
def test_pool_with_lookahead_is_never_over_allocated_and_all_free_at_the_end(kind):
    spec = speculative(a=0.8, k=4, num_blocks=48, max_num_seqs=32)
    reqs = requests(rate=30.0, n=150, prefix_fraction=0.6, num_prefixes=2)
    out = Outcomes.empty(len(reqs))
    sim = kind(spec, reqs, out)
    replay(sim, reqs)
    assert out.preemptions.sum() > 0 and out.num_accepted_tokens > 0  # the pool really ran dry; drafts landed
    assert sim.peak_blocks_used <= spec.num_blocks
    assert np.isnan(out.finish).sum() == 0
    sim.check_finished()


@pytest.mark.parametrize("simulator", ["engine", "fast"])
def test_identical_seeds_give_identical_results(simulator):
    reqs = requests(rate=15.0, n=120, prefix_fraction=0.4)
    runs = [simulate(speculative(seed=seed, num_blocks=80, max_num_seqs=32), reqs, 2, "least-loaded",
                     simulator=simulator).outcomes for seed in (11, 11, 12)]
    for name in ("first_token", "finish", "preemptions", "cached_tokens", "replica"):
        np.testing.assert_array_equal(getattr(runs[0], name), getattr(runs[1], name))
    assert runs[0].num_accepted_tokens == runs[1].num_accepted_tokens
    assert not np.array_equal(runs[0].finish, runs[2].finish)


@pytest.mark.parametrize("rkw,wkw,replicas,a", [
    ({}, {"prefix_fraction": 0.8}, 1, 0.7),
    ({"num_blocks": 60, "max_num_seqs": 32}, {"rate": 20.0, "prefix_fraction": 0.7}, 3, 0.9),
    ({"num_blocks": 200, "max_num_seqs": 32, "max_num_batched_tokens": 64}, {"rate": 50.0}, 1, 0.5),
])
def test_fast_path_reproduces_the_engine_scheduler_exactly(rkw, wkw, replicas, a):
    """Preemption, prefix hits, a binding token budget: the two simulators agree step for step."""
    spec, reqs = speculative(a=a, k=4, **rkw), requests(n=150, **wkw)
    runs = [simulate(spec, reqs, replicas, "round-robin", simulator=s) for s in ("engine", "fast")]
    x, y = (r.outcomes for r in runs)
    assert x.steps == y.steps and x.num_accepted_tokens == y.num_accepted_tokens > 0
    for name in ("first_token", "finish", "preemptions", "cached_tokens", "replica"):
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
    assert runs[0].peak_blocks_used == runs[1].peak_blocks_used


def _json(argv, capsys) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model,draft,tp", [("llama-3-8b", "smollm2-135m", "1"), ("llama-3-70b", "llama-3-8b", "4")])
def test_blocks_with_a_draft_are_the_plans(model, draft, tp, capsys):
    common = [model, "--gpu", "h100", "--tensor-parallel-size", tp]
    fleet = ["fleet"] + common + ["--rate", "1", "--num-requests", "3", "--prompt-len", "256", "--output-len", "16"]
    with_draft = _json(fleet + ["--draft", draft, "--acceptance-rate", "0.7"], capsys)
    without = _json(fleet, capsys)
    planned = _json(["plan"] + common + ["--draft", draft, "--acceptance-rate", "0.7"], capsys)["speculative"]
    blocks = with_draft["replica"]["num_blocks"]
    assert blocks == planned["pool_blocks"] < without["replica"]["num_blocks"]
    budget = with_draft["replica"]["kv_budget_bytes_per_rank"]  # blocks hold both caches, per rank
    assert blocks * planned["pool_bytes_per_block"] <= budget < (blocks + 1) * planned["pool_bytes_per_block"]
    spec = with_draft["result"]["speculative"]
    assert (spec["draft"], spec["acceptance_rate"], spec["num_speculative_tokens"]) == (draft, 0.7, 3)
    assert with_draft["replica"]["speculative"]["draft_cost"]["kind"] == "roofline"


def test_calibrated_pool_is_recut_for_both_caches(tmp_path, capsys):
    """A draft the target's own size: the calibrated pool's bytes hold half the blocks; the draft costs 1x."""
    cal = calibration_file(tmp_path)
    argv = ["fleet", "smollm2-135m", "--calibration", cal, "--rate", "2", "--num-requests", "5",
            "--prompt-len", "64", "--output-len", "8", "--draft", "smollm2-135m", "--acceptance-rate", "0.5"]
    data = _json(argv, capsys)
    assert data["replica"]["num_blocks"] == 500
    assert data["replica"]["speculative"]["draft_cost"] == {"kind": "scaled", "ratio": 1.0,
                                                           "of": "the calibrated target step cost"}


@pytest.mark.parametrize("flags,message", [
    (["--acceptance-rate", "0.5"], "--acceptance-rate needs --draft"),
    (["--draft", "smollm2-135m", "--acceptance-rate", "1.5"], "--acceptance-rate must be in [0, 1]"),
    (["--draft", "smollm2-135m", "--acceptance-rate", "-0.1"], "--acceptance-rate must be in [0, 1]"),
    (["--draft", "smollm2-135m", "--acceptance-rate", "0.5", "--num-speculative-tokens", "0"], "positive integer"),
    (["--draft", "smollm2-135m"], "--draft needs --acceptance-rate"),
])
def test_speculative_mistakes_are_one_line(flags, message, capsys):
    try:  # argparse's own refusals exit 2 from inside; kvlab's errors return 2
        code = main(["fleet", "llama-3-8b", "--gpu", "h100", "--num-requests", "3"] + flags)
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
