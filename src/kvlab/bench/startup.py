"""Cold start-up of kvlab's commands, one fresh process per figure: plan, engine, serve.

What a user waits for before the first thing happens: `kvlab plan FILE.gguf` and `kvlab plan
NAME` to exit, a Python process to hold a ready `LLMEngine` (imports, torch's included, the
GGUF read, the planes built), and `kvlab serve NAME` to answer 200 on /health, then how long
that server's first one-token completion takes (the first forward pass in a process); the
engine's process also reports its imports and its load (`load_for_engine` + `LLMEngine`). Each
figure is a new process, so Python and torch start from nothing; the file is in the OS page
cache after the warm-up round (dropping it needs root and would disturb other work here).
Where the environment sets PYTHONDONTWRITEBYTECODE, every run compiles kvlab's sources anew;
`--pycache DIR` measures what an install with bytecode sees instead.

Several source trees can be compared (`--tree main=/work/main/src --tree branch=src`): each
run puts one tree first on PYTHONPATH, and the trees take turns within every round (the order
alternates between rounds), so a shared machine's drift falls on all alike; ratios are of
medians from the same run. Results are printed and written as JSON with provenance.

    flock /tmp/kvlab-heavy.lock kvlab bench startup --tree main=/work/main/src \\
        --tree branch=src --runs 5 --json-out reports/startup/startup.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional

from kvlab.errors import KvlabError

MEASURES = ("plan_file", "plan_name", "engine", "engine_imports", "engine_load", "serve_health",
            "serve_first_completion")
ENGINE_SNIPPET = (  # prints how long its imports (torch's included) and the load itself took
    "import sys, time\n"
    "start = time.perf_counter()\n"
    "from kvlab.engine.engine import EngineConfig, LLMEngine\n"
    "from kvlab.engine.llm import load_for_engine\n"
    "imported = time.perf_counter()\n"
    "model, tokenizer = load_for_engine(sys.argv[1])\n"
    "LLMEngine(model, tokenizer, EngineConfig())\n"
    "print('ready', imported - start, time.perf_counter() - imported, flush=True)\n"
)
TIMEOUT_S = 180.0


def _env(tree: str, pycache: Optional[str] = None) -> dict:
    """The environment a run of `tree` gets; with `pycache`, bytecode is written and read there
    (PYTHONPYCACHEPREFIX), as an installed package's __pycache__ would be, sources untouched."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.abspath(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if pycache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.abspath(pycache)
    return env


def time_exit(command: list[str], env: dict) -> float:
    """Seconds from spawning `command` to its exit (it must succeed)."""
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=TIMEOUT_S)
    return time.perf_counter() - start


def time_ready(command: list[str], env: dict) -> tuple[float, float, float]:
    """(seconds from spawning `command` to the line "ready IMPORTS LOAD" on its stdout, IMPORTS, LOAD)."""
    start = time.perf_counter()
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as child:
        line = child.stdout.readline()
        elapsed = time.perf_counter() - start
        child.wait(timeout=TIMEOUT_S)
    words = line.split()
    if len(words) != 3 or words[0] != "ready" or child.returncode:
        raise RuntimeError(f"{' '.join(command)} did not get an engine ready (exit {child.returncode})")
    return elapsed, float(words[1]), float(words[2])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _request(url: str, body: Optional[bytes] = None) -> int:
    headers = {"Content-Type": "application/json"} if body else {}
    with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=60) as response:
        response.read()
        return response.status


def time_serve(kvlab: str, model: str, env: dict) -> tuple[float, float]:
    """(seconds from spawning `kvlab serve` to 200 on /health, seconds of the first 1-token completion)."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    child = subprocess.Popen([kvlab, "serve", model, "--port", str(port), "--log-level", "warning"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if child.poll() is not None:
                raise RuntimeError(f"kvlab serve {model} exited ({child.returncode}) before /health answered")
            if time.perf_counter() - start > TIMEOUT_S:
                raise RuntimeError(f"kvlab serve {model}: no 200 on /health within {TIMEOUT_S:.0f} s")
            try:
                if _request(base + "/health") == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.02)
        health = time.perf_counter() - start
        body = b'{"model": "%s", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}' % (
            model.encode())
        begin = time.perf_counter()
        if _request(base + "/v1/completions", body) != 200:
            raise RuntimeError("the first completion failed")
        return health, time.perf_counter() - begin
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def round_of(kvlab: str, gguf: str, model: str, env: dict) -> dict[str, float]:
    """One cold figure of every measure for one tree."""
    figures = {"plan_file": time_exit([kvlab, "plan", gguf], env),
               "plan_name": time_exit([kvlab, "plan", model], env)}
    figures["engine"], figures["engine_imports"], figures["engine_load"] = time_ready(
        [sys.executable, "-c", ENGINE_SNIPPET, model], env)
    figures["serve_health"], figures["serve_first_completion"] = time_serve(kvlab, model, env)
    return figures


def run_bench(trees: dict[str, str], runs: int, warmup: int, kvlab: str, gguf: str, model: str,
              pycache: Optional[str] = None, report: Callable[[str], None] = print) -> dict:
    """Interleaved rounds over `trees` (label -> src folder); the medians and ratios to the first tree."""
    samples: dict[str, dict[str, list[float]]] = {m: {label: [] for label in trees} for m in MEASURES}
    labels = list(trees)
    for index in range(warmup + runs):
        order = labels if index % 2 == 0 else labels[::-1]
        for label in order:
            figures = round_of(kvlab, gguf, model, _env(trees[label], pycache))
            counted = index >= warmup
            report(f"{'run ' + str(index - warmup + 1) if counted else 'warm-up'} {label}: "
                   + ", ".join(f"{m} {v:.3f} s" for m, v in figures.items()))
            if counted:
                for measure, value in figures.items():
                    samples[measure][label].append(value)
    results = {}
    for measure in MEASURES:
        medians = {label: statistics.median(values) for label, values in samples[measure].items()}
        results[measure] = {"samples_s": samples[measure], "median_s": medians,
                            "ratio_to_" + labels[0]: {label: medians[label] / medians[labels[0]] for label in labels}}
    return results


def run_command(args: argparse.Namespace) -> int:
    """`kvlab bench startup`: time every tree, print the medians, write --json-out."""
    kvlab = args.kvlab or shutil.which("kvlab")
    if not kvlab:
        raise KvlabError("no kvlab executable on PATH; give --kvlab")
    trees = dict(item.split("=", 1) for item in (args.tree or [f"this={Path(__file__).resolve().parents[2]}"]))
    from kvlab.checkpoints.resolve import resolve_model_path

    gguf = args.gguf or resolve_model_path(args.model)
    results = run_bench(trees, args.runs, args.warmup, kvlab, gguf, args.model, args.pycache)
    labels = list(trees)
    print(f"\nmedian of {args.runs} cold runs (s):  " + "  ".join(f"{label:>10}" for label in labels)
          + (f"   ratio {labels[1]}/{labels[0]}" if len(labels) == 2 else ""))
    for measure in MEASURES:
        medians = results[measure]["median_s"]
        line = f"{measure:>30}:  " + "  ".join(f"{medians[label]:>10.3f}" for label in labels)
        if len(labels) == 2:
            line += f"   {medians[labels[1]] / medians[labels[0]]:.2f}"
        print(line)
    if args.json_out:
        from kvlab.bench.provenance import git_state, provenance
        from kvlab.files import write_json

        record = {"benchmark": "startup", "model": args.model, "gguf": gguf, "kvlab_executable": kvlab,
                  "runs": args.runs, "warmup": args.warmup,
                  "bytecode": (f"cached under {args.pycache} (PYTHONPYCACHEPREFIX)" if args.pycache else
                               "as the environment has it: PYTHONDONTWRITEBYTECODE="
                               + os.environ.get("PYTHONDONTWRITEBYTECODE", "(unset)")),
                  "trees": {label: {"src": os.path.abspath(src), "git_commit": git_state(src)[0]}
                            for label, src in trees.items()},
                  "method": "each figure a fresh process; trees alternate within every round; OS page cache warm",
                  "results": results, "provenance": provenance()}
        write_json(args.json_out, record)
        print(f"wrote {args.json_out}")
    return 0
