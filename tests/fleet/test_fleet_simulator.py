"""The simulator: conservation, a pool never over-allocated, determinism, the engine's own classes,
and the fast path agreeing with the engine's scheduler step for step."""

import numpy as np
import pytest
from fleet_helpers import replay, replica, requests

import kvlab.engine.build as engine_module  # where the engine makes its scheduler and block manager
from kvlab.engine.block_manager import BlockManager
from kvlab.engine.scheduler import Scheduler
from kvlab.fleet.fleet import simulate
from kvlab.fleet.outcomes import Outcomes
from kvlab.fleet.replica_engine import EngineReplica
from kvlab.fleet.replica_fast import FastReplica

# (replica kwargs, workload kwargs, replicas, router): light load; shared prefixes; a pool so small that
# requests are preempted; a token budget that binds (chunked prefill); three replicas behind each router
CASES = [
    ({}, {}, 1, "round-robin"),
    ({}, {"prefix_fraction": 0.8}, 1, "round-robin"),
    ({"num_blocks": 60, "max_num_seqs": 32}, {"rate": 20.0, "output": "uniform:64:0.9"}, 1, "round-robin"),
    ({"num_blocks": 60, "max_num_seqs": 32}, {"rate": 20.0, "prefix_fraction": 0.7}, 3, "least-loaded"),
    ({"num_blocks": 200, "max_num_seqs": 32, "max_num_batched_tokens": 64}, {"rate": 50.0, "prefix_fraction": 0.5},
     3, "round-robin"),
    ({"num_blocks": 40, "max_num_seqs": 32, "max_num_batched_tokens": 2048}, {"rate": 10.0, "prefix_fraction": 0.9},
     1, "least-loaded"),
]


@pytest.mark.parametrize("rkw,wkw,replicas,router", CASES)
def test_fast_path_reproduces_the_engine_scheduler_exactly(rkw, wkw, replicas, router):
    spec, reqs = replica(**rkw), requests(**wkw)
    a = simulate(spec, reqs, replicas, router, simulator="engine").outcomes
    b = simulate(spec, reqs, replicas, router, simulator="fast").outcomes
    assert a.steps == b.steps
    np.testing.assert_array_equal(a.first_token, b.first_token)
    np.testing.assert_array_equal(a.finish, b.finish)
    np.testing.assert_array_equal(a.preemptions, b.preemptions)
    np.testing.assert_array_equal(a.cached_tokens, b.cached_tokens)
    np.testing.assert_array_equal(a.replica, b.replica)


@pytest.mark.parametrize("replicas", [1, 3])
def test_fast_path_is_close_with_several_prefixes_competing_for_a_small_pool(replicas):
    """Where the fast path's LRU model is approximate (several prefix groups evicting each other under
    preemption), the tails and throughput stay within a few percent of the engine's scheduler."""
    from kvlab.fleet.results import summarise
    spec, reqs = replica(num_blocks=60, max_num_seqs=32), requests(rate=20.0, prefix_fraction=0.7, num_prefixes=3)
    a = summarise(simulate(spec, reqs, replicas, "least-loaded", simulator="engine"), 1)
    b = summarise(simulate(spec, reqs, replicas, "least-loaded", simulator="fast"), 1)
    assert a["preemptions"] > 0
    for metric in ("ttft_ms", "tpot_ms", "e2el_ms"):
        for p in ("p50", "p95"):
            assert b[metric][p] == pytest.approx(a[metric][p], rel=0.05)
    assert b["request_throughput"] == pytest.approx(a["request_throughput"], rel=0.02)


def test_the_cases_exercise_preemption_prefix_hits_and_chunking():
    """The agreement above means something only if the hard paths ran."""
    heavy = simulate(replica(num_blocks=60, max_num_seqs=32), requests(rate=20.0, prefix_fraction=0.7), 1,
                     simulator="engine").outcomes
    assert heavy.preemptions.sum() > 0 and heavy.cached_tokens.sum() > 0
    chunked = replica(max_num_batched_tokens=64)
    reqs = requests(rate=50.0)
    assert (reqs.prompt_len > 64).any()
    assert simulate(chunked, reqs, 1, simulator="engine").outcomes.steps > \
        simulate(replica(), reqs, 1, simulator="engine").outcomes.steps


@pytest.mark.parametrize("simulator", ["engine", "fast"])
def test_every_request_is_accounted_for(simulator):
    reqs = requests(rate=20.0, n=400, prefix_fraction=0.5)
    reqs.prompt_len[7] = 5000  # over max_model_len: refused at admission, as the engine refuses it
    out = simulate(replica(num_blocks=60, max_num_seqs=32), reqs, 2, "least-loaded", simulator=simulator).outcomes
    done = ~np.isnan(out.finish)
    assert out.rejected[7] and not done[7]
    assert (done ^ out.rejected).all()  # each request finished or was refused, never lost, never both
    assert done.sum() == len(reqs) - 1
    assert (out.first_token[done] >= reqs.arrival[done]).all()
    assert (out.finish[done] >= out.first_token[done]).all()
    one = done & (reqs.output_len == 1)
    assert (out.finish[one] == out.first_token[one]).all()


class CheckedFast(FastReplica):
    def step(self):
        super().step()
        assert 0 <= self.free <= self.spec.num_blocks
        assert self.taken >= 0


class CheckedEngine(EngineReplica):
    def step(self, limit=float("inf")):
        moved = super().step(limit)
        used = self.blocks.num_blocks - self.blocks.num_free
        held = {b for seq in self.scheduler.running for b in seq.block_table}
        assert used == len(held) <= self.spec.num_blocks
        assert all(self.blocks.blocks[b].ref_count > 0 for b in held)
        return moved


@pytest.mark.parametrize("kind", [CheckedEngine, CheckedFast])
def test_kv_pool_is_never_over_allocated(kind):
    spec = replica(num_blocks=48, max_num_seqs=32)
    reqs = requests(rate=30.0, n=200, prefix_fraction=0.6, num_prefixes=2)
    out = Outcomes.empty(len(reqs))
    sim = kind(spec, reqs, out)
    replay(sim, reqs)
    assert out.preemptions.sum() > 0  # the pool really ran dry
    assert sim.peak_blocks_used <= spec.num_blocks
    assert np.isnan(out.finish).sum() == 0


@pytest.mark.parametrize("simulator", ["engine", "fast"])
def test_identical_seeds_give_identical_results(simulator):
    spec = replica(num_blocks=80, max_num_seqs=32)
    runs = [simulate(spec, requests(rate=15.0, seed=seed, prefix_fraction=0.4), 2, "least-loaded",
                     simulator=simulator).outcomes for seed in (11, 11, 12)]
    for name in ("first_token", "finish", "preemptions", "cached_tokens", "replica"):
        np.testing.assert_array_equal(getattr(runs[0], name), getattr(runs[1], name))
    assert not np.array_equal(runs[0].finish, runs[2].finish)


def test_the_simulator_drives_the_engines_own_scheduler_and_block_manager(monkeypatch):
    """One policy, two clocks: the classes are the engine's (not copies), and every step goes through them."""
    assert engine_module.Scheduler is Scheduler and engine_module.BlockManager is BlockManager
    reqs = requests(n=50)
    out = Outcomes.empty(len(reqs))
    sim = EngineReplica(replica(), reqs, out)
    assert type(sim.scheduler) is Scheduler and type(sim.blocks) is BlockManager
    calls = []
    original = Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule", lambda self, now: calls.append(now) or original(self, now))
    replay(sim, reqs)
    assert len(calls) == out.steps > 0
    assert calls == sorted(calls)  # the virtual clock only moves forward


def test_md1_mean_wait_matches_the_closed_form():
    """One seat, one-step service of exactly S seconds, Poisson arrivals: M/D/1, Wq = rho S / (2 (1 - rho))."""
    from kvlab.fleet.step_cost import LinearCost
    service = 0.1
    cost = LinearCost(0.0, 0.0, 0.0, service, 0.0, 0.0)
    rho = 0.7
    reqs = requests(rate=rho / service, n=60_000, prompt="32", output="1", seed=5)
    out = simulate(replica(max_num_seqs=1, cost=cost), reqs, 1, simulator="fast").outcomes
    wait = out.first_token - reqs.arrival - service
    expected = rho * service / (2 * (1 - rho))
    batches = wait.reshape(30, -1).mean(axis=1)  # batch means: the waits are correlated
    stderr = batches.std(ddof=1) / np.sqrt(len(batches))
    assert abs(wait.mean() - expected) < 3 * stderr
    assert stderr < 0.05 * expected  # and the test is sharp enough to mean something
    small = requests(rate=rho / service, n=2000, prompt="32", output="1", seed=5)
    a = simulate(replica(max_num_seqs=1, cost=cost), small, 1, simulator="engine").outcomes
    b = simulate(replica(max_num_seqs=1, cost=cost), small, 1, simulator="fast").outcomes
    np.testing.assert_array_equal(a.first_token, b.first_token)
