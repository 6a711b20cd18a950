"""The reliability figures for reports/serving: a real `kvlab serve` under 1,000 streamed requests with hang-ups.

    kvlab bench reliability [--model smollm2-135m] [--requests 1000] [--json PATH]

What tests/reliability/test_load.py asserts, measured and written down: `--requests` random
short requests at concurrency 32, a tenth of the clients hanging up mid-stream, against one
server process after a warm-up load. Figures: requests sent, completed, cancelled by the
client, failed; HTTP statuses; the server's own counters (/metrics) once idle (running,
waiting, KV pool usage: blocks leaked); resident memory after the warm-up and after the load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time

import httpx


def server_metrics(base_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        match = re.match(r"^kvlab:(\w+)\{[^}]*\} ([0-9.e+-]+)$", line)
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


def wait_idle(base_url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server_metrics(base_url)
        idle = m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(model: str, requests: int, concurrency: int, disconnect: float, threads: int, seed: int) -> dict:
    from kvlab.bench.peers import Running, free_ports, known_peer
    from kvlab.bench.provenance import provenance
    from kvlab.bench.serve import ServeBenchConfig, run_level, with_disconnects
    from kvlab.bench.serve_data import load_tokenizer, random_requests
    from kvlab.bench.serve_metrics import calculate_metrics
    from kvlab.checkpoints.resolve import resolve_model_path

    path = resolve_model_path(model)
    tok = load_tokenizer(path)
    port = free_ports(1)[0]
    server = Running(known_peer("kvlab", port, path, None, threads, "kvlab-bench", "64MiB"), port)
    config = ServeBenchConfig(server.base_url, "kvlab-bench", ignore_eos=True, request_timeout=120, seed=seed)

    def load(num: int, load_seed: int):
        reqs = with_disconnects(random_requests(num, 10, 8, 0.75, 0, load_seed, tok), disconnect, load_seed)
        outputs, duration = asyncio.run(run_level(config, reqs, concurrency, extras=True))
        return reqs, calculate_metrics(outputs, duration, tok, ("ttft", "e2el"), (99,))

    try:
        load(128, seed + 1)  # warm-up: allocator, kernels, connections at full concurrency
        wait_idle(server.base_url)
        warm_rss, before = rss_bytes(server.proc.pid), server_metrics(server.base_url)
        reqs, m = load(requests, seed + 2)
        idle = wait_idle(server.base_url)
        after_rss = rss_bytes(server.proc.pid)
    finally:
        server.stop()
    return {"benchmark": "reliability", "model": model, "requests_sent": requests, "max_concurrency": concurrency,
            "disconnect_fraction": disconnect, "client_hang_ups_planned": sum(r.disconnect_after is not None
                                                                             for r in reqs),
            "completed": m["completed"], "cancelled": m["cancelled"], "failed": m["failed"],
            "status_counts": m["status_counts"], "duration_s": m["duration"],
            "output_throughput": m["output_throughput"], "p99_e2el_ms": m.get("p99_e2el_ms"),
            "server_after": {k: idle[k] for k in ("num_requests_running", "num_requests_waiting",
                                                  "kv_cache_usage_perc")},
            "generation_tokens_during_load": idle["generation_tokens_total"] - before["generation_tokens_total"],
            "client_counted_output_tokens": m["total_output_tokens"],
            "rss_after_warmup_bytes": warm_rss, "rss_after_load_bytes": after_rss,
            "rss_change_fraction": (after_rss - warm_rss) / warm_rss if warm_rss else None,
            "lost": requests - m["completed"] - m["cancelled"] - m["failed"],
            "provenance": provenance(threads)}


def run_command(args: argparse.Namespace) -> int:
    """`kvlab bench reliability`: measure, print the figures, write --json."""
    threads = args.threads or os.cpu_count() or 1
    r = measure(args.model, args.requests, args.max_concurrency, args.disconnect_fraction, threads, args.seed)
    print(f"{r['requests_sent']} requests at concurrency {r['max_concurrency']}: {r['completed']} completed, "
          f"{r['cancelled']} cancelled by the client, {r['failed']} failed, {r['lost']} lost; statuses "
          f"{r['status_counts']}; afterwards {r['server_after']}; RSS {r['rss_after_warmup_bytes'] / 2**20:.0f} -> "
          f"{r['rss_after_load_bytes'] / 2**20:.0f} MiB")
    if args.json:
        from kvlab.files import write_json
        write_json(args.json, r)
    return 0
