"""`kvlab bench compare`: the same serving sweep against several servers, in one run, as one table.

Every peer gets the same requests (built once, from one seed, with the model's tokenizer) and
is measured by the same client as `kvlab bench serve` (kvlab.bench.serve). By default all
peers are started first and the sweep is interleaved: at each concurrency level every peer runs
in turn, so slow drift of a shared machine falls on all of them alike and the ratios compare
like with like. `one_at_a_time` instead starts, sweeps and stops one peer after another (for a
machine without the memory to hold them all). A peer that cannot start is reported with the
reason and the sweep goes on without it. Ratios are kvlab's output throughput over each peer's,
per level, from this run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from kvlab.bench.peers import Peer, Running, Skipped
from kvlab.bench.serve import ServeBenchConfig, level_result, probe, run_level
from kvlab.bench.serve_data import BenchError, SampleRequest

TABLE_METRICS = ("ttft", "tpot", "itl", "e2el")


def requests_needed(levels: Sequence[int], per_level: Callable[[int], int]) -> int:
    """Requests a sweep's workload must hold: every level's, none shared (Sweep.level_requests)."""
    return sum(per_level(level) for level in levels)


@dataclass
class Sweep:
    """What every peer is asked: the requests of each level and how they are sent."""

    # prompt length -> its requests; each level takes a slice of its own (level_requests)
    workloads: dict[int, list[SampleRequest]]
    levels: list[int]
    per_level: Callable[[int], int]  # requests sent at a level
    endpoint: str = "/v1/completions"
    ignore_eos: bool = True
    seed: int = 0
    request_timeout: float = 300.0
    percentiles: Sequence[float] = (90.0, 99.0)

    def requests_needed(self) -> int:
        """Requests a workload must hold: every level's, none shared."""
        return requests_needed(self.levels, self.per_level)

    def level_requests(self, input_len: int, level: int) -> list[SampleRequest]:
        """The requests of one level: the slice after the earlier levels' ones. Shared prompts would let a
        server with prefix caching answer a later level from the cache an earlier one filled."""
        start = sum(self.per_level(earlier) for earlier in self.levels[:self.levels.index(level)])
        return self.workloads[input_len][start:start + self.per_level(level)]


def _config(sweep: Sweep, base_url: str, model: str, extras: Optional[bool]) -> ServeBenchConfig:
    return ServeBenchConfig(base_url, model, sweep.endpoint, None, float("inf"), 1.0, sweep.seed, sweep.ignore_eos,
                            extras, {"temperature": 0.0}, TABLE_METRICS, sweep.percentiles, None,
                            sweep.request_timeout)


class _Entry:
    """One peer's state through the run: started or not, its probe, its levels' results."""

    def __init__(self, peer: "Peer | Skipped") -> None:
        self.peer, self.running, self.runs = peer, None, []
        self.status = "skipped" if isinstance(peer, Skipped) else "pending"
        self.reason = peer.reason if isinstance(peer, Skipped) else ""
        self.extras, self.model, self.startup_s = False, "", None

    def start(self, port: int, sweep: Sweep, say: Callable[[str], None]) -> bool:
        say(f"{self.peer.name}: starting ({' '.join(self.peer.argv[:6])} ...)")
        try:
            self.running = Running(self.peer, port)
            self.startup_s = self.running.startup_s
            self.model = _first_model(self.running.base_url)
            config = _config(sweep, self.running.base_url, self.model, self.peer.vllm_extras)
            first = next(iter(sweep.workloads.values()))[0]
            self.extras, _ = asyncio.run(probe(config, first))  # also the warm-up request
        except BenchError as error:
            self.status, self.reason = "failed to start", str(error)
            say(f"{self.peer.name}: skipped: {error}")
            self.stop()
            return False
        self.status = "ran"
        say(f"{self.peer.name}: up in {self.startup_s:.1f} s, model {self.model!r}, vLLM extras "
            f"{'sent' if self.extras else 'not sent'}")
        return True

    def run_level(self, sweep: Sweep, input_len: int, level: int, tokenizer, on_done=None) -> dict:
        config = _config(sweep, self.running.base_url, self.model, self.extras)
        requests = sweep.level_requests(input_len, level)
        load = os.getloadavg()[0]  # kept with the result: a busy machine shows here
        outputs, duration = asyncio.run(run_level(config, requests, level, self.extras, on_done))
        result = {"input_len": input_len, **level_result(config, outputs, duration, level, tokenizer)}
        result["requested_output_tokens"] = sum(r.expected_output_len for r in requests)
        result["load_average_1m_before"] = round(load, 2)
        if self.running.proc.poll() is not None:
            result["server_exited"] = self.running.proc.returncode
        self.runs.append(result)
        return result

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()

    def to_json(self) -> dict:
        peer = self.peer
        out = {"name": peer.name, "status": self.status, "reason": self.reason or None}
        if isinstance(peer, Peer):
            out.update({"argv": peer.argv, "note": peer.note, "startup_s": self.startup_s, "model_id": self.model,
                        "vllm_extras": self.extras, "runs": self.runs})
        return out


def _first_model(base_url: str) -> str:
    from kvlab.bench.serve import server_models

    models = server_models(ServeBenchConfig(base_url, ""))
    if not models:
        raise BenchError(f"{base_url} serves no model")
    return str(models[0].get("id"))


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM (a `timeout`, a job killed) handled as Ctrl-C while the sweep runs: without it Python dies at once,
    the `finally` that resumes and stops the servers never runs, and the paused (SIGSTOP) servers are left
    behind holding their memory, with nothing of the cells measured written. Main thread only (signal's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_compare(peers: Sequence["Peer | Skipped"], ports: Sequence[int], sweep: Sweep, tokenizer,
                say: Callable[[str], None], one_at_a_time: bool = False, progress=None) -> dict:
    """Start the peers, run the sweep (interleaved by level unless `one_at_a_time`), stop them; the result JSON.

    `progress(total)` returns a callable ticked once per finished request, or None.
    """
    entries = [_Entry(peer) for peer in peers]
    for entry in entries:
        if entry.status == "skipped":
            say(f"{entry.peer.name}: skipped: {entry.reason}")
    live = [(e, port) for e, port in zip(entries, ports) if e.status == "pending"]
    cells = [(input_len, level) for input_len in sweep.workloads for level in sweep.levels]
    per_peer = sum(sweep.per_level(level) for _, level in cells)
    tick = progress(per_peer * len(live)) if progress else None
    interrupted = False
    with terminate_as_interrupt():  # the servers are stopped however the sweep ends
        try:
            if one_at_a_time:
                for entry, port in live:
                    if entry.start(port, sweep, say):
                        for input_len, level in cells:
                            entry.run_level(sweep, input_len, level, tokenizer, tick)
                        entry.stop()
            else:
                started = []
                for entry, port in live:
                    if entry.start(port, sweep, say):
                        entry.running.pause()
                        started.append(entry)
                for input_len, level in cells:
                    for entry in started:
                        entry.running.resume()
                        try:
                            entry.run_level(sweep, input_len, level, tokenizer, tick)
                        finally:
                            entry.running.pause()
                        last = entry.runs[-1]
                        say(f"{entry.peer.name}: prompt {input_len}, concurrency {level}: "
                            f"{last['output_throughput']:.1f} output tok/s, {last['failed']} failed")
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what was measured, say it is partial
            interrupted = True
            say("interrupted: the result holds the cells measured so far")
        finally:
            for entry, _ in live:
                entry.stop()
    result = {"benchmark": "compare", "interrupted": interrupted, "input_lens": list(sweep.workloads), "levels": sweep.levels,
              "order": "one peer at a time" if one_at_a_time else
              "all peers up; each (prompt length, concurrency) cell run by every peer in turn, the others paused",
              "peers": [entry.to_json() for entry in entries]}
    result["cells"] = ratios(result["peers"], cells)
    return result


def ratios(peers: list[dict], cells: Sequence[tuple[int, int]]) -> list[dict]:
    """Per (prompt length, concurrency): kvlab's output throughput over each other peer's, and the best peer."""
    ran = {p["name"]: {(r["input_len"], r["max_concurrency"]): r for r in p.get("runs", [])}
           for p in peers if p["status"] == "ran"}
    out = []
    for cell in cells:
        mine = ran.get("kvlab", {}).get(cell)
        others = {name: runs[cell] for name, runs in ran.items() if name != "kvlab" and cell in runs}
        entry: dict = {"input_len": cell[0], "max_concurrency": cell[1], "kvlab_over_peer": {}, "best_peer": None}
        if others:
            best = max(others, key=lambda name: others[name]["output_throughput"])
            entry["best_peer"] = {"name": best, "output_throughput": others[best]["output_throughput"]}
        if mine is not None:
            entry["kvlab_over_peer"] = {
                name: (mine["output_throughput"] / run["output_throughput"] if run["output_throughput"] > 0 else None)
                for name, run in others.items()}
        out.append(entry)
    return out


def comparison_table(result: dict):
    """One rich table: a row per (level, peer) with throughput, the ratio, and the latency figures."""
    from rich.table import Table

    table = Table(title="kvlab bench compare: same requests, same client, same run")
    for title, justify in (("prompt", "right"), ("conc.", "right"), ("server", "left"), ("ok/failed", "right"),
                           ("tokens back", "right"), ("out tok/s", "right"), ("kvlab / it", "right"), ("TTFT mean", "right"),
                           ("TTFT p99", "right"), ("TPOT mean", "right"), ("TPOT p99", "right"),
                           ("ITL mean", "right")):
        table.add_column(title, justify=justify)
    for cell in result["cells"]:
        key = (cell["input_len"], cell["max_concurrency"])
        for peer in result["peers"]:
            run = next((r for r in peer.get("runs", []) if (r["input_len"], r["max_concurrency"]) == key), None)
            if run is None:
                continue
            r = cell["kvlab_over_peer"].get(peer["name"])
            table.add_row(str(key[0]), str(key[1]), peer["name"], f"{run['completed']}/{run['failed']}",
                          f"{run['total_output_tokens']}/{run['requested_output_tokens']}",
                          f"{run['output_throughput']:.1f}", "-" if r is None else f"{r:.2f}x",
                          *(_ms(run.get(key)) for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                                                          "p99_tpot_ms", "mean_itl_ms")))
        table.add_section()
    return table


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"
