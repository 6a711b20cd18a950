"""A `kvlab fleet` run from its flags: the workload, the replica, the fleet size, the sweep, the figures."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from typing import Optional

from kvlab.fleet.errors import FleetError
from kvlab.fleet.fleet import simulate
from kvlab.fleet.results import summarise
from kvlab.fleet.service import ReplicaSpec
from kvlab.fleet.sizing import smallest_fleet
from kvlab.fleet.step_cost import EFFICIENCY_SOURCES
from kvlab.fleet.workload import Requests, Workload, draw
from kvlab.plan.spec import ModelSpec

TIMELINE_POINTS = 600


@dataclass
class Scenario:
    spec: ModelSpec
    workload: Workload
    replica: ReplicaSpec
    replicas: int = 1
    router: str = "least-loaded"
    simulator: str = "auto"
    slo: Optional[dict] = None
    find_min_cards: bool = False
    price_per_card_hour: Optional[float] = None
    price_per_mtok: Optional[float] = None
    sweep_rates: list[float] = field(default_factory=list)
    card_name: Optional[str] = None
    calibration: Optional[dict] = None
    tp_options: list[ReplicaSpec] = field(default_factory=list)  # replicas of 1x, 2x, 4x.. the weights' cards
    bar: object = None  # a rich Progress while run(progress=True) is running

    def _requests(self, rate: Optional[float] = None) -> Requests:
        workload = self.workload
        if rate is not None and workload.trace is None:
            duration = workload.num_requests / workload.rate
            workload = replace(workload, rate=rate, num_requests=max(1, round(duration * rate)))
        return draw(workload)

    def _summary(self, requests: Requests, replicas: int, timeline: bool = False, sizing: bool = False,
                 replica: Optional[ReplicaSpec] = None, label: Optional[str] = None) -> dict:
        replica = replica or self.replica
        span = float(requests.arrival[-1]) if len(requests) else 1.0
        abort = None
        if sizing and self.slo and "ttft" in self.slo:  # a queue holding 4x the SLO's worth of arrivals cannot meet it
            abort = int(4 * self.slo["ttft"] / 1000 * len(requests) / max(span, 1e-9)) + replicas * replica.max_num_seqs
        bar = self.bar
        task = None
        if bar is not None:
            task = bar.add_task(label or f"{replicas} x TP{replica.cards}", total=len(requests))
        run = simulate(replica, requests, replicas, self.router, self.simulator,
                       sample_every=max(span, 1e-3) / TIMELINE_POINTS * replicas if timeline else None,
                       abort_waiting=abort,
                       progress=None if task is None else (lambda i: bar.update(task, completed=i)))
        if task is not None:
            bar.remove_task(task)
        summary = summarise(run, replica.cards, self.slo, self.price_per_card_hour, self.price_per_mtok)
        if timeline:
            summary["timeline"] = [list(row) for row in run.outcomes.timeline]
        return summary

    def saturated(self, replica: ReplicaSpec) -> float:
        """Requests/s one replica completes when always full: a burst of 4 x its seats from this workload."""
        burst = self._requests().head(4 * replica.max_num_seqs)
        burst = replace(burst, arrival=np.zeros(len(burst)))
        return max(summarise(simulate(replica, burst, 1, simulator=self.simulator), 1)["request_throughput"], 1e-9)

    def _size(self, requests: Requests) -> tuple[int, list[dict]]:
        """Replicas of self.replica for the SLO; with tp_options, the tensor-parallel degree too (fewest cards)."""
        if not self.find_min_cards:
            return self.replicas, []
        if not self.slo:
            raise FleetError("--find-min-cards needs --slo, e.g. --slo ttft:2000 tpot:50")
        best = None
        trials_all = []
        for replica in self.tp_options or [self.replica]:
            start = max(1, int(len(requests) / max(float(requests.arrival[-1]), 1e-9) / self.saturated(replica)))
            def meets_with(n: int, replica=replica):
                summary = self._summary(requests, n, sizing=True, replica=replica)
                return summary["meets_slo"], summary
            try:
                n, _, trials = smallest_fleet(meets_with, start)
            except FleetError:
                continue
            trials_all += [dict(t, cards_per_replica=replica.cards) for t in trials]
            if best is None or n * replica.cards < best[0] * best[1].cards:
                best = (n, replica)
        if best is None:
            raise FleetError("no fleet of up to 4096 replicas meets the SLO (is one request alone over it?)")
        self.replica = best[1]
        return best[0], trials_all

    def run(self, progress: bool = False) -> dict:
        """Size (if asked), simulate, sweep; with `progress`, rich bars on stderr for each simulation."""
        if not progress:
            return self._run()
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True) as self.bar:
            try:
                return self._run()
            finally:
                self.bar = None

    def _run(self) -> dict:
        requests = self._requests()
        replicas, trials = self._size(requests)
        main = self._summary(requests, replicas, timeline=True)
        result = {"model": self.spec.name, "card": self.card_name, "workload": self.workload.describe(),
                  "replica": self.replica.describe(), "result": main,
                  "cards_for_weights": (self.tp_options[0] if self.tp_options else self.replica).cards}
        if self.calibration is None:
            result["efficiency_sources"] = EFFICIENCY_SOURCES
        else:
            result["calibration"] = {k: self.calibration.get(k) for k in ("model", "fit", "fit_quality", "engine")}
        if trials:
            result["min_cards"] = {"replicas": replicas, "cards": replicas * self.replica.cards, "trials": trials}
        rows = []
        for rate in self.sweep_rates:
            reqs = self._requests(rate)
            n, _ = self._size(reqs)
            summary = self._summary(reqs, n)
            row = {"rate": rate, "replicas": n, "ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"],
                   "e2el_ms": summary["e2el_ms"], "request_throughput": summary["request_throughput"]}
            if self.find_min_cards:
                row["cards_needed"] = n * self.replica.cards
            if "cost" in summary:
                row["dedicated_per_mtok"] = summary["cost"]["dedicated_per_mtok"]
            rows.append(row)
        if rows:
            result["sweep"] = rows
        return result

    def figures(self, result: dict, directory: str) -> list[str]:
        from kvlab.fleet.figures import kv_timeline, latency_vs_rate
        out = Path(directory)
        name = re.sub(r"[^a-z0-9.]+", "-", self.spec.name.lower()).strip("-")
        made = [kv_timeline(result["result"].get("timeline", []), out / f"{name}-kv-usage.png",
                            f"{self.spec.name}: KV pool over time ({result['result']['replicas']} replicas)")]
        if result.get("sweep"):
            made.append(latency_vs_rate(result["sweep"], out / f"{name}-latency-vs-rate.png",
                                        f"{self.spec.name} on {self.card_name or 'calibrated engine'}", self.slo))
        return made
