"""How kvlab's commands degrade when another process holds a core, with the thread governor and without.

A step's OpenMP threads meet at hundreds of barriers; beside a busy process a thread waiting for
a descheduled partner loses a scheduler quantum, so a step can slow far more than its fair share
(kvlab.nn.threads). This benchmark runs `kvlab measure` (batch-1 decode through the engine) and
`kvlab bench throughput` (16 requests at once) as fresh processes, each with KVLAB_THREADS=fixed
(every step on all threads, the behaviour before the governor) and the default (the governor),
on a quiet machine and beside a synthetic load (one process spinning on a core), the contenders
taking turns round by round. A fair share beside one busy process on two cores is about half
the quiet speed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

POLICIES = ("fixed", "adaptive")
SPIN = "while True: pass"


@contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """One process spinning on a core while the body runs (nothing when `on` is false)."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if on else None
    try:
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def commands(model: str, new_tokens: int) -> dict[str, tuple[list[str], str]]:
    """Each measured command's argv and the figure read from its JSON (`{json}`: the file it writes
    its JSON to; without it, the JSON is the command's standard output)."""
    kvlab = [sys.executable, "-m", "kvlab"]
    return {
        "measure": (kvlab + ["measure", model, "--prompt-len", "128", "--new-tokens", str(new_tokens),
                             "--kv-cache-dtype", "fp16", "--json"], "decode_tokens_per_s"),
        "throughput": (kvlab + ["bench", "throughput", model, "--num-prompts", "16", "--input-len", "128",
                                "--output-len", str(new_tokens), "--kv-cache-dtype", "fp16", "--no-llama-cpp",
                                "--json", "{json}"], "batched.output_tokens_per_s"),
    }


def _figure(result: dict, key: str) -> float:
    for part in key.split("."):
        result = result[part]
    return float(result)


def run_once(argv: list[str], key: str, policy: str) -> Optional[float]:
    """One fresh process of the command under `policy`; its figure, or None when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, KVLAB_THREADS=policy)
        done = subprocess.run([str(out) if a == "{json}" else a for a in argv], env=env, capture_output=True,
                              text=True)
        text = out.read_text() if "{json}" in argv and out.exists() else done.stdout
        if done.returncode != 0 or not text.strip():
            print(f"kvlab bench shared-cpu: {' '.join(argv[3:5])} failed: {done.stderr.strip()[-300:]}",
                  file=sys.stderr)
            return None
        return _figure(json.loads(text), key)


def run(model: str, rounds: int, new_tokens: int, only: Optional[list[str]] = None, progress=None) -> dict:
    """Figures per command, load and policy: every round runs each contender once, in turn."""
    figures: dict = {}
    for name, (argv, key) in commands(model, new_tokens).items():
        if only and name not in only:
            continue
        for loaded in (False, True):
            cell = figures.setdefault(name, {}).setdefault("beside a busy core" if loaded else "quiet", {})
            for _ in range(rounds):
                for policy in POLICIES:
                    with busy_core(loaded):
                        value = run_once(argv, key, policy)
                    if value is not None:
                        cell.setdefault(policy, []).append(value)
                    if progress is not None:
                        progress.update()
    return {"benchmark": "shared-cpu", "model": model, "rounds": rounds, "new_tokens": new_tokens,
            "load": SPIN + " (one process, one core)", "figures": figures, "summary": summarise(figures)}


def summarise(figures: dict) -> dict:
    """Median per cell, and each policy's loaded speed as a share of its quiet speed."""
    out = {}
    for name, loads in figures.items():
        medians = {load: {p: statistics.median(v) for p, v in cell.items() if v} for load, cell in loads.items()}
        shares = {p: medians["beside a busy core"].get(p, 0.0) / medians["quiet"][p]
                  for p in POLICIES if medians.get("quiet", {}).get(p)}
        out[name] = {"median": medians, "loaded_share_of_quiet": shares}
    return out
