"""A real `kvlab serve` under 1,000 streamed requests at concurrency 32, a tenth of them hanging up mid-stream.

Nothing may be lost: every request completes or is one the client itself abandoned, no
answer is a 5xx, and afterwards the server holds nothing (no running request, every KV
block free) and its resident memory is back within 10% of where it stood after a warm-up.
Bounded: a fixed number of requests, each with a 60 s limit, and the whole test a few tens of
seconds on two cores (stories260K, 2..14 new tokens each).
"""

from __future__ import annotations

import asyncio

import pytest

from kvlab.bench.serve import ServeBenchConfig, run_level, with_disconnects
from kvlab.bench.serve_data import load_tokenizer, random_requests
from kvlab.bench.serve_metrics import calculate_metrics
from needs import STORIES, require_file
from server_helpers import Served


def load(served: Served, num: int, seed: int, disconnect: float = 0.1, concurrency: int = 32):
    """`num` random short requests at `concurrency`, `disconnect` of them hanging up; (outputs, metrics)."""
    tok = load_tokenizer(str(STORIES))
    reqs = with_disconnects(random_requests(num, 10, 8, 0.75, 0, seed, tok), disconnect, seed)
    config = ServeBenchConfig(served.base, served.name, ignore_eos=True, request_timeout=60, seed=seed)
    outputs, duration = asyncio.run(run_level(config, reqs, concurrency, extras=True))
    return reqs, outputs, calculate_metrics(outputs, duration, tok, ("e2el",), (99,))


@pytest.fixture(scope="module")
def served():
    require_file(STORIES, "../shared/models/stories260K.gguf")
    server = Served(str(STORIES), "--kv-cache-memory", "4MB", "--block-size", "8", "--max-model-len", "128")
    yield server
    assert server.stop() == 0


def test_a_thousand_requests_with_hang_ups_lose_nothing_and_leak_nothing(served):
    load(served, 128, seed=1)  # warm-up: allocator, kernels, connection handling at full concurrency
    served.wait_idle()
    warm = served.rss_bytes()
    before = served.metrics()
    reqs, outputs, m = load(served, 1000, seed=2)
    cancelled = sum(r.disconnect_after is not None for r in reqs)
    assert cancelled >= 90
    assert m["failed"] == 0, [o.error for o in outputs if not o.success and not o.cancelled][:5]
    assert (m["completed"], m["cancelled"]) == (1000 - cancelled, cancelled)
    assert m["status_counts"] == {"200": 1000 - cancelled}  # no 5xx, nothing but 200 among the answered
    idle = served.wait_idle(timeout=30)
    assert idle["num_requests_running"] == 0 and idle["num_requests_waiting"] == 0
    assert idle["kv_cache_usage_perc"] == 0  # every block back in the pool, hung-up requests' too
    # the completed requests' tokens were all generated; the hung-up ones stopped early
    grown = idle["generation_tokens_total"] - before["generation_tokens_total"]
    assert grown >= m["total_output_tokens"]
    assert grown < m["total_output_tokens"] + sum(r.expected_output_len for r in reqs if r.disconnect_after)
    rss = served.rss_bytes()
    assert abs(rss - warm) <= 0.10 * warm, f"RSS {warm / 2**20:.1f} MiB after warm-up, {rss / 2**20:.1f} MiB after"
