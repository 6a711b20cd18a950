"""reports/fleet's worked examples and the day-long speed run: `kvlab fleet` runs, saved as JSON.

`kvlab bench fleet-report` runs the data-centre sizing (three attention layouts x two KV dtypes,
plus a rate sweep), the speculative-decoding fleet, the edge robot loop and a day of traffic, each
through the same parser and scenario as `kvlab fleet` (the command layer hands them in as
`scenario_of(argv)` and `plan_of(argv)`, so this module needs no parser), and writes
datacentre.json, speculative.json, edge.json and day.json with provenance. The page is
kvlab.report.fleet's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from kvlab.bench.fleet_examples import ACCEPTANCE, DATACENTRE, DAY, DRAFT, DTYPES, EDGE, SPECULATIVE, VARIANTS


class FleetExamples:
    """The examples, run into `out`. `scenario_of(argv)`: the Scenario `kvlab fleet ARGV` would run;
    `plan_of(argv)`: the plan `kvlab plan ARGV` would print (a dict)."""

    def __init__(self, out: Path, scenario_of: Callable[[list[str]], object], plan_of: Callable[[list[str]], dict]):
        self.out, self.scenario_of, self.plan_of = Path(out), scenario_of, plan_of

    def fleet(self, command: str, plot: bool = False) -> dict:
        """One `kvlab fleet` run in-process, its timeline dropped (the figures draw it)."""
        argv = command.split()
        scenario = self.scenario_of(argv)
        result = scenario.run()
        if plot:
            result["figures"] = [os.path.relpath(p, self.out) for p in scenario.figures(result, str(self.out))]
        result["command"] = "kvlab fleet " + " ".join(argv)
        result["result"].pop("timeline", None)
        return result

    def write(self, name: str, data: dict) -> None:
        from kvlab.bench.provenance import provenance
        from kvlab.files import write_json

        write_json(self.out / name, {**data, "provenance": provenance()})

    def datacentre(self) -> None:
        rows = []
        for label, flags in VARIANTS:
            for dtype in DTYPES:
                started = time.perf_counter()
                r = self.fleet(f"{DATACENTRE} --kv-cache-dtype {dtype} {flags}".strip(),
                               plot=(label, dtype) == ("MHA", "fp16"))
                r["label"], r["kv_dtype"], r["wall_seconds"] = label, dtype, time.perf_counter() - started
                rows.append(r)
                print(f"datacentre {label} {dtype}: {r['min_cards']['cards']} cards", flush=True)
        sweep = self.fleet(f"{DATACENTRE} --kv-cache-dtype fp8 --sweep-rates 10,25,50,75,100", plot=True)
        self.write("datacentre.json", {"rows": rows, "sweep": sweep})

    def edge(self) -> None:
        rows = []
        for caching in ("", " --no-prefix-caching"):
            r = self.fleet(EDGE + caching + " --sweep-rates 5,10,20,40,80", plot=not caching)
            r["prefix_caching"] = not caching
            rows.append(r)
        self.write("edge.json", {"rows": rows})

    def speculative(self) -> None:
        """Llama-3-70B GQA-8 fp8 KV on TP8 replicas, without and with a Llama-3.2-1B draft (k = 4) at three
        acceptance rates: the fewest replicas for the SLO, the tails, the bill."""
        rows = []
        for a in (None,) + ACCEPTANCE:
            flags = "" if a is None else f" --draft {DRAFT} --acceptance-rate {a} --num-speculative-tokens 4"
            started = time.perf_counter()
            r = self.fleet(SPECULATIVE + flags)
            r["acceptance_rate"], r["wall_seconds"] = a, time.perf_counter() - started
            if a is not None:  # the planner's batch-1 figures for the same draft, for comparison
                argv = ["llama-3-70b", "--gpu", "h100", "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "8",
                        "--draft", DRAFT, "--acceptance-rate", str(a), "--num-speculative-tokens", "4"]
                r["plan_speculative"] = self.plan_of(argv)["speculative"]
                r["plan_command"] = "kvlab plan " + " ".join(argv)
            rows.append(r)
            print(f"speculative a={a}: {r['min_cards']['cards']} cards", flush=True)
        self.write("speculative.json", {"rows": rows})

    def day(self) -> None:
        """A day at 100 req/s: the fleet sized on ten minutes of the same traffic, then the whole day, timed."""
        sizing = self.fleet(DAY.format(replicas=1, tp=1).replace("--duration 86400", "--duration 600").replace(
            "--replicas 1 --tensor-parallel-size 1", "--slo ttft:2000 tpot:50 --find-min-cards").replace(
            " --simulator fast", ""))
        replicas, tp = sizing["min_cards"]["replicas"], sizing["replica"]["cards"]
        started = time.perf_counter()
        r = self.fleet(DAY.format(replicas=replicas, tp=tp))
        r["total_wall_seconds"] = time.perf_counter() - started
        r["sized_on"] = sizing["command"]
        self.write("day.json", r)
        print(f"day: {r['result']['requests']:,} requests in {r['total_wall_seconds']:.0f} s", flush=True)
