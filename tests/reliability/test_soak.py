"""Soak (slow): `kvlab serve` under minutes of mixed load; memory flat, nothing lost, the pool empty after each round.

Rounds alternate closed-loop load at concurrency 8, 32 and 64 with open-loop Poisson arrivals,
each with a tenth of the clients hanging up. Bounded: at most 24 rounds of 300 requests, and no
new round once 180 s have passed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvlab.bench.serve import ServeBenchConfig, run_level, with_disconnects
from kvlab.bench.serve_data import load_tokenizer, random_requests
from kvlab.bench.serve_metrics import calculate_metrics
from needs import STORIES, require_file
from server_helpers import Served

SOAK_SECONDS, MAX_ROUNDS, PER_ROUND = 180, 24, 300


@pytest.mark.slow
def test_soak_memory_stays_flat_and_nothing_is_lost():
    require_file(STORIES, "../shared/models/stories260K.gguf")
    tok = load_tokenizer(str(STORIES))
    served = Served(str(STORIES), "--kv-cache-memory", "4MB", "--block-size", "8", "--max-model-len", "192")
    try:
        started, rss, rounds = time.monotonic(), [], 0
        while rounds < MAX_ROUNDS and time.monotonic() - started < SOAK_SECONDS:
            concurrency, rate = [(8, float("inf")), (32, float("inf")), (64, 60.0), (64, float("inf"))][rounds % 4]
            reqs = with_disconnects(random_requests(PER_ROUND, 24, 24, 0.9, 8 * (rounds % 2), rounds, tok), 0.1, rounds)
            config = ServeBenchConfig(served.base, served.name, ignore_eos=rounds % 3 != 0, request_rate=rate,
                                      request_timeout=60, seed=rounds)
            outputs, duration = asyncio.run(run_level(config, reqs, concurrency, extras=True))
            m = calculate_metrics(outputs, duration, tok, (), ())
            assert m["failed"] == 0 and m["completed"] + m["cancelled"] == PER_ROUND, m["status_counts"]
            idle = served.wait_idle(timeout=30)
            assert idle["kv_cache_usage_perc"] == 0 and idle["num_requests_running"] == 0
            rss.append(served.rss_bytes())
            rounds += 1
        assert rounds >= 4
        assert max(rss[1:]) <= 1.10 * rss[0], [f"{r / 2**20:.0f} MiB" for r in rss]  # after round 1 as warm-up
    finally:
        assert served.stop() == 0
