"""The smallest fleet that meets an SLO at a rate: simulate growing replica counts, then bisect.

Meeting the SLO is taken to be monotone in the number of replicas (more replicas never make
the tail worse under these routers), so doubling finds a fleet that meets it and bisection
the smallest one; every count tried is reported.
"""

from __future__ import annotations

from typing import Callable

from kvlab.fleet.errors import FleetError

MAX_REPLICAS = 4096


def smallest_fleet(meets_with: Callable[[int], tuple[bool, dict]], start: int = 1) -> tuple[int, dict, list[dict]]:
    """(replicas, that run's summary, every trial) for the fewest replicas where `meets_with(n)[0]`.

    `start` is a count known to be too small or just enough (rate / one replica's saturated
    throughput, rounded down): fewer replicas than that are overloaded and are not tried.
    """
    trials: list[dict] = []
    cache: dict[int, tuple[bool, dict]] = {}

    def trial(n: int) -> bool:
        if n not in cache:
            cache[n] = meets_with(n)
            trials.append({"replicas": n, "meets_slo": cache[n][0], "p95_ttft_ms": cache[n][1]["ttft_ms"]["p95"],
                           "p95_tpot_ms": cache[n][1]["tpot_ms"]["p95"]})
        return cache[n][0]

    low, high = max(1, start) - 1, max(1, start)
    while not trial(high):
        low, high = high, high * 2
        if high > MAX_REPLICAS:
            raise FleetError(f"no fleet of up to {MAX_REPLICAS} replicas meets the SLO (is one request alone "
                             "over it? see --slo)")
    while high - low > 1:
        middle = (low + high) // 2
        if trial(middle):
            high = middle
        else:
            low = middle
    return high, cache[high][1], sorted(trials, key=lambda t: t["replicas"])
