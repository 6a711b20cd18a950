"""Small replicas and workloads for the fleet tests (seconds of CPU, never a model)."""

import json
from dataclasses import asdict
from pathlib import Path

from kvlab.fleet.service import ReplicaSpec
from kvlab.fleet.step_cost import LinearCost
from kvlab.fleet.workload import LengthDist, Workload, draw

COST = LinearCost(decode_base=0.010, decode_per_seq=0.001, decode_per_ctx=1e-6, mixed_base=0.020,
                  mixed_per_token=0.0002, mixed_per_pair=1e-8)
# the engine a calibration file says it was measured on: 1,001 blocks of 16 tokens, fp32
ENGINE = {"num_blocks": 1001, "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 512,
          "max_model_len": 2048, "kv_cache_dtype": "auto", "dtype": "fp32"}


def calibration_file(directory: Path) -> str:
    """A `kvlab fleet --calibration` file in `directory`: COST's fit on ENGINE (what `kvlab fleet calibrate`
    writes, less its samples)."""
    path = Path(directory) / "cal.json"
    fit = {name: value for name, value in asdict(COST).items() if name != "kind"}
    path.write_text(json.dumps({"fit": fit, "engine": ENGINE}))
    return str(path)


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
