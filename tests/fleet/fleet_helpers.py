"""Small replicas and workloads for the fleet tests (seconds of CPU, never a model)."""

from kvlab.fleet.service import ReplicaSpec
from kvlab.fleet.step_cost import LinearCost
from kvlab.fleet.workload import LengthDist, Workload, draw

COST = LinearCost(decode_base=0.010, decode_per_seq=0.001, decode_per_ctx=1e-6, mixed_base=0.020,
                  mixed_per_token=0.0002, mixed_per_pair=1e-8)


def replica(num_blocks=400, max_num_seqs=16, max_num_batched_tokens=256, block_size=16, prefix_caching=True,
            cost=COST, max_model_len=2048):
    return ReplicaSpec(1, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, cost,
                       prefix_caching)


def requests(rate=4.0, n=300, prompt="uniform:128:0.5", output="uniform:64:0.5", prefix_fraction=0.0,
             prefix_len=100, seed=3, num_prefixes=1):
    return draw(Workload(rate, n, LengthDist.parse(prompt), LengthDist.parse(output), 1.0, prefix_fraction,
                         prefix_len, num_prefixes, seed))


def replay(sim, reqs) -> None:
    """Feed a replica simulator every request at its arrival time, then run it dry."""
    for i, t in enumerate(reqs.arrival):
        sim.advance_until(float(t))
        sim.add(i, float(t))
    sim.drain()
