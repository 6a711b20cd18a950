"""Validate `kvlab fleet` against the real engine here: `kvlab bench serve` on `kvlab serve` versus the simulator.

`kvlab bench fleet-validate`: for each workload (low, medium, saturating load of SmolLM2-135M) a
fresh `kvlab serve` is started with the calibration's engine settings, `kvlab bench serve` sends
vLLM's random dataset at the given Poisson rate and seed, and the simulator runs the same
requests: the same arrival offsets (kvlab.fleet.workload.arrival_times is the bench's arrival
process), the prompt lengths the server counted (its usage, BOS included) and the asked output
lengths (--ignore-eos), on the engine's own Scheduler with the calibrated step cost. The result
(reports/fleet/validation.json) is rendered by kvlab.report.fleet.
Run it alone (it measures): flock /tmp/kvlab-heavy.lock kvlab bench fleet-validate
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from kvlab.bench.serve_data import random_requests
from kvlab.errors import KvlabEnvironmentError
from kvlab.fleet.fleet import simulate
from kvlab.fleet.results import summarise
from kvlab.fleet.service import ReplicaSpec, load_calibration
from kvlab.fleet.workload import Requests, arrival_times

SRC = str(Path(__file__).resolve().parents[2])  # the kvlab the child processes import: this one


def child_env() -> dict:
    """The environment of the `kvlab` child processes: this kvlab first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}


INPUT_LEN, OUTPUT_LEN, RANGE = 128, 64, 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_of(calibration_path: str) -> tuple[ReplicaSpec, dict]:
    cost, data = load_calibration(calibration_path)
    e = data["engine"]
    return ReplicaSpec(1, e["num_blocks"], e["block_size"], e["max_num_seqs"], e["max_num_batched_tokens"],
                       e["max_model_len"], cost, True), data


def capacity(replica: ReplicaSpec, seed: int) -> float:
    """Requests/s the calibrated replica completes when always full (a burst of 4 x max_num_seqs)."""
    n = 4 * replica.max_num_seqs
    reqs = lengths(n, seed, np.zeros(n), None)
    run = simulate(replica, reqs, 1, simulator="engine")
    return summarise(run, 1)["request_throughput"]


def lengths(n: int, seed: int, arrival: np.ndarray, prompt_lens) -> Requests:
    asked = random_requests(n, INPUT_LEN, OUTPUT_LEN, RANGE, 0, seed, None)
    if prompt_lens is None:  # the bench's draw of lengths, plus the BOS the server adds
        rng = np.random.default_rng(seed)
        lo, hi = int(INPUT_LEN * (1 - RANGE)), int(np.ceil(INPUT_LEN * (1 + RANGE)))
        prompt_lens = rng.integers(lo, hi + 1, size=n) + 1
    return Requests(np.asarray(arrival, float), np.asarray(prompt_lens, np.int64),
                    np.array([r.expected_output_len for r in asked], np.int64), np.full(n, -1, np.int64),
                    np.zeros(n, np.int64))


def serve(model: str, engine: dict, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvlab.cli", "serve", model, "--port", str(port), "--log-level", "warning",
            "--kv-cache-memory", str(engine["kv_cache_memory"]), "--max-num-seqs", str(engine["max_num_seqs"]),
            "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
            "--block-size", str(engine["block_size"])]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=child_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KvlabEnvironmentError(f"kvlab serve exited {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise KvlabEnvironmentError("kvlab serve did not start within 120 s")


def warm_up(model: str, port: int) -> None:
    """Two requests before measuring: the first forward of a process (kernel load, page faults
    in the pool, torch's first-call paths) is far slower than later ones, and the simulator's
    calibration is of a warm engine. Among 28 requests one cold TTFT alone moves the p95."""
    for prompt, tokens in (("Once upon a time " * 40, 16), ("Hello", 8)):
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}).raise_for_status()


def bench(model: str, port: int, rate: float, n: int, seed: int, path: str) -> dict:
    argv = [sys.executable, "-m", "kvlab.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
            "--model", model, "--dataset-name", "random", "--input-len", str(INPUT_LEN), "--output-len",
            str(OUTPUT_LEN), "--range-ratio", str(RANGE), "--ignore-eos", "--request-rate", str(rate),
            "--num-prompts", str(n), "--seed", str(seed), "--metric-percentiles", "50,95,99",
            "--save-result", "--save-detailed", "--result-file", path, "--disable-tqdm", "--tokenizer", model]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=child_env())
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data["results"][0] if "results" in data else data


@functools.lru_cache(maxsize=1)
def _loaded(model: str):
    """The model and tokenizer, loaded once for every workload's in-process replay."""
    from kvlab.engine.llm import load_for_engine

    return load_for_engine(model)


def engine_only(model: str, engine: dict, reqs: Requests) -> dict:
    """The same requests through the engine in this process, no HTTP and no client: arrivals
    replayed in real time, each step run as soon as the previous ends. Set beside the server's
    figures, it tells the simulator's error (against this) from the serving path's overhead
    (the server's figures against this), which on two cores includes the benchmark client."""
    from kvlab.engine.engine import EngineConfig, LLMEngine
    from kvlab.engine.sampling import SamplingParams

    net, tokenizer = _loaded(model)
    eng = LLMEngine(net, tokenizer, EngineConfig(
        kv_cache_memory=engine["kv_cache_memory"], block_size=engine["block_size"],
        max_num_seqs=engine["max_num_seqs"], max_num_batched_tokens=engine["max_num_batched_tokens"]))
    eng.add_request("Once upon a time " * 40, SamplingParams(max_tokens=16))  # warm, as the server was
    while eng.has_unfinished():
        eng.step()
    rng = np.random.default_rng(0)
    order = list(range(len(reqs.arrival)))
    times: dict[str, list[float]] = {}
    start = time.monotonic()
    while order or eng.has_unfinished():
        now = time.monotonic() - start
        while order and reqs.arrival[order[0]] <= now:
            i = order.pop(0)
            ids = [int(t) for t in rng.integers(1000, 20000, int(reqs.prompt_len[i]))]
            seq = eng.add_request(ids, SamplingParams(max_tokens=int(reqs.output_len[i]), ignore_eos=True))
            times[seq.request_id] = [start + float(reqs.arrival[i])]
        if not eng.has_unfinished():
            time.sleep(max(0.0, start + float(reqs.arrival[order[0]]) - time.monotonic()))
            continue
        for delta in eng.step():
            if delta.token_ids:
                times[delta.request_id].append(time.monotonic())
    elapsed = max(v[-1] for v in times.values()) - start
    ttft = [v[1] - v[0] for v in times.values()]
    tpot = [(v[-1] - v[1]) / (len(v) - 2) for v in times.values() if len(v) > 2]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3  # noqa: E731
    return {"request_throughput": len(times) / elapsed,
            **{f"p{q}_ttft_ms": pct(ttft, q) for q in (50, 95)}, **{f"p{q}_tpot_ms": pct(tpot, q) for q in (50, 95)}}


def validate(model: str, calibration_path: str, loads: list[float], seconds: float, min_prompts: int,
             seed: int) -> dict:
    """Measure each load (as a fraction of the simulated capacity) on a fresh server and predict it;
    the rows with their relative errors, printed one line each as they finish."""
    from kvlab.bench.provenance import provenance

    replica, calibration = replica_of(calibration_path)
    cap = capacity(replica, seed)
    rows = []
    names = ("low", "medium", "saturating")
    for name, load in zip(names, loads):
        rate = round(load * cap, 3)
        n = max(min_prompts, int(seconds * rate))
        port = free_port()
        proc = serve(model, calibration["engine"], port)
        try:
            warm_up(model, port)
            load_before = os.getloadavg()[0]
            with tempfile.TemporaryDirectory() as tmp:
                measured = bench(model, port, rate, n, seed, os.path.join(tmp, "bench.json"))
            load_after = os.getloadavg()[0]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        reqs = lengths(n, seed, arrival_times(n, rate, 1.0, seed), measured.get("input_lens"))
        predicted = summarise(simulate(replica, reqs, 1, simulator="engine"), 1)
        in_process = engine_only(model, calibration["engine"], reqs) if name in ("low", "medium") else None
        row = {"workload": name, "load": load, "rate": rate, "num_prompts": n,
               "load_average_1min": [round(load_before, 2), round(load_after, 2)],
               "measured": {"request_throughput": measured["request_throughput"],
                            "output_throughput": measured["output_throughput"],
                            "completed": measured["completed"], "failed": measured["failed"],
                            **{f"{p}_{m}_ms": measured[f"{'median' if p == 'p50' else p}_{m}_ms"]
                               for m in ("ttft", "tpot", "e2el") for p in ("p50", "p95")}},
               "predicted": {"request_throughput": predicted["request_throughput"],
                             "output_throughput": predicted["output_throughput"],
                             "completed": predicted["completed"], "preemptions": predicted["preemptions"],
                             **{f"{p}_{m}_ms": predicted[f"{m}_ms"][p] for m in ("ttft", "tpot", "e2el")
                                for p in ("p50", "p95")}}}
        if in_process is not None:
            row["engine_only"] = in_process
            row["errors_vs_engine_only"] = {k: row["predicted"][k] / in_process[k] - 1 for k in in_process}
        row["errors"] = {k: row["predicted"][k] / row["measured"][k] - 1 for k in
                         ("request_throughput", "p50_ttft_ms", "p95_ttft_ms", "p50_tpot_ms", "p95_tpot_ms")
                         if row["measured"][k]}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("workload", "rate", "errors")}), flush=True)
    result = {"model": model, "calibration": os.path.relpath(calibration_path),
              "simulated_capacity_req_s": cap, "workload": {"dataset": "random", "input_len": INPUT_LEN,
                                                            "output_len": OUTPUT_LEN, "range_ratio": RANGE,
                                                            "arrivals": "Poisson", "seed": seed},
              "targets": {"request_throughput": 0.10, "p95_ttft_ms": 0.25, "at": ["low", "medium"]},
              "rows": rows, "provenance": provenance()}
    return result
