"""A fleet of identical replicas behind a router, simulated request by request on one virtual clock.

Before each arrival every replica runs the steps that start before it (so the router sees each
replica's state at that instant); then the router places the request: `round-robin`, or
`least-loaded` (fewest requests running plus waiting, lowest index on ties). Afterwards every
replica drains. `engine` replicas run kvlab.engine's Scheduler and BlockManager; `fast`
replicas run the same policy with aggregated decoders (kvlab.fleet.replica_fast), or with a draft
model each decoder on its own (kvlab.fleet.replica_fast_spec).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from kvlab.fleet.errors import FleetError
from kvlab.fleet.outcomes import Outcomes
from kvlab.fleet.replica_engine import EngineReplica
from kvlab.fleet.replica_fast import FastReplica
from kvlab.fleet.replica_fast_spec import SpeculativeFastReplica
from kvlab.fleet.service import ReplicaSpec
from kvlab.fleet.speculation import Speculation
from kvlab.fleet.workload import Requests

ROUTERS = ("round-robin", "least-loaded")
SIMULATORS = ("engine", "fast", "auto")
AUTO_ENGINE_TOKENS = 500_000  # prompt + output tokens: up to here `auto` runs the engine's own scheduler


@dataclass
class FleetRun:
    requests: Requests
    outcomes: Outcomes
    replicas: int
    simulator: str
    router: str
    wall_seconds: float
    peak_blocks_used: list[int]
    aborted: bool = False  # stopped early: the queue outgrew `abort_waiting` (a fleet too small to matter)
    speculation: Optional[Speculation] = None


def simulate(spec: ReplicaSpec, requests: Requests, replicas: int = 1, router: str = "round-robin",
             simulator: str = "auto", sample_every: Optional[float] = None,
             progress: Optional[Callable[[int], None]] = None, abort_waiting: Optional[int] = None) -> FleetRun:
    """Run `requests` through `replicas` copies of `spec`; the outcome arrays say what happened to each."""
    if router not in ROUTERS:
        raise FleetError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if simulator not in SIMULATORS:
        raise FleetError(f"--simulator must be one of {', '.join(SIMULATORS)}, got {simulator!r}")
    if replicas < 1:
        raise FleetError(f"a fleet needs at least one replica, got {replicas}")
    if simulator == "auto":
        total = int(requests.prompt_len.sum() + requests.output_len.sum())
        simulator = "engine" if total <= AUTO_ENGINE_TOKENS else "fast"
    if simulator == "fast" and spec.max_num_seqs > spec.max_num_batched_tokens:
        raise FleetError("the fast simulator needs --max-num-seqs <= --max-num-batched-tokens; use --simulator engine")
    out = Outcomes.empty(len(requests))
    kind = EngineReplica if simulator == "engine" else SpeculativeFastReplica if spec.speculation else FastReplica
    fleet = [kind(spec, requests, out, r, sample_every) for r in range(replicas)]
    started = time.perf_counter()
    arrivals = requests.arrival.tolist()
    every = max(1, len(arrivals) // 200)
    for i, t in enumerate(arrivals):
        if router == "round-robin" or replicas == 1:  # replicas are independent: only the chosen one must catch up
            target = fleet[i % replicas]
            target.advance_until(t)
        else:
            for replica in fleet:
                replica.advance_until(t)
            target = min(fleet, key=lambda r: r.load)
        target.add(i, t)
        if i % every == 0:
            if progress is not None:
                progress(i)
            if abort_waiting is not None and sum(len(r.waiting) if simulator == "fast" else len(r.scheduler.waiting)
                                                 for r in fleet) > abort_waiting:
                return FleetRun(requests, out, replicas, simulator, router, time.perf_counter() - started,
                                [r.peak_blocks_used for r in fleet], aborted=True, speculation=spec.speculation)
    for replica in fleet:
        replica.drain()
    if progress is not None:
        progress(len(arrivals))
    return FleetRun(requests, out, replicas, simulator, router, time.perf_counter() - started,
                    [r.peak_blocks_used for r in fleet], speculation=spec.speculation)
