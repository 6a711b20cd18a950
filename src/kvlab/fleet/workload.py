"""Who arrives when, asking for what: arrival times, prompt and output lengths, shared prefixes.

Arrivals are vLLM's `get_request` process (kvlab.bench.serve_client.arrival_offsets): gamma
gaps of shape `burstiness` (1 = Poisson) with mean 1/rate, drawn from numpy's default_rng(seed),
so a simulated run and `kvlab bench serve` with the same seed send requests at the same offsets.
Lengths are fixed, uniform in [m(1-r), m(1+r)] (vLLM's random dataset's range ratio), lognormal
with a given mean and sigma, or read with the arrivals from a JSONL trace.
A `prefix_fraction` of requests start with one of `num_prefixes` shared prefixes of
`prefix_len` tokens (a system prompt, a robot's fixed instructions) that the prefix cache can serve.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvlab.fleet.errors import FleetError

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `fixed:M`, `uniform:M:R` or `lognormal:M:SIGMA` (M the mean)."""

    kind: str
    mean: int
    spread: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        parts = str(text).strip().lower().split(":")
        try:
            if len(parts) == 1:
                parts = ["fixed"] + parts
            kind, mean = parts[0], int(parts[1])
            spread = float(parts[2]) if len(parts) > 2 else (0.0 if kind == "fixed" else 0.5)
        except ValueError:
            raise FleetError(f"cannot read length {text!r}; expected e.g. 512, uniform:512:0.5, lognormal:512:0.8")
        if kind not in DISTRIBUTIONS or mean < 1 or spread < 0 or (kind == "uniform" and spread >= 1):
            raise FleetError(f"cannot read length {text!r}; expected fixed:M, uniform:M:R (0<=R<1) or "
                             "lognormal:M:SIGMA with M >= 1")
        return cls(kind, mean, spread)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed" or self.spread == 0:
            return np.full(n, self.mean, dtype=np.int64)
        if self.kind == "uniform":  # vLLM's random dataset: integers in [floor(m(1-r)), ceil(m(1+r))]
            lo, hi = max(1, math.floor(self.mean * (1 - self.spread))), max(1, math.ceil(self.mean * (1 + self.spread)))
            return rng.integers(lo, hi + 1, size=n).astype(np.int64)
        mu = math.log(self.mean) - self.spread ** 2 / 2  # so that the mean is `mean`
        return np.maximum(1, np.rint(rng.lognormal(mu, self.spread, size=n))).astype(np.int64)

    def label(self) -> str:
        return str(self.mean) if self.kind == "fixed" else f"{self.kind}:{self.mean}:{self.spread:g}"


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second
    num_requests: int
    prompt: LengthDist
    output: LengthDist
    burstiness: float = 1.0
    prefix_fraction: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 1
    seed: int = 0
    trace: Optional[str] = None  # JSONL: {"arrival": s, "prompt_len": n, "output_len": m[, "prefix_id": k]}

    def validate(self) -> None:
        if self.trace is None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise FleetError(f"--rate must be a positive finite number of requests/s, got {self.rate}")
        if self.trace is None and self.num_requests < 1:
            raise FleetError(f"the workload needs at least one request, got {self.num_requests}")
        if not 0 <= self.prefix_fraction <= 1:
            raise FleetError(f"--prefix-fraction must be in [0, 1], got {self.prefix_fraction}")
        if self.prefix_fraction > 0 and self.prefix_len < 1:
            raise FleetError("--prefix-fraction needs --prefix-len > 0")
        if self.burstiness <= 0:
            raise FleetError(f"--burstiness must be positive, got {self.burstiness}")

    def describe(self) -> dict:
        return {"rate": self.rate, "num_requests": self.num_requests, "prompt": self.prompt.label(),
                "output": self.output.label(), "burstiness": self.burstiness, "prefix_fraction": self.prefix_fraction,
                "prefix_len": self.prefix_len, "num_prefixes": self.num_prefixes, "seed": self.seed,
                "trace": self.trace}


@dataclass
class Requests:
    """The workload drawn: one row per request, sorted by arrival. prompt_len includes the prefix."""

    arrival: np.ndarray  # seconds, float64
    prompt_len: np.ndarray  # int64
    output_len: np.ndarray  # int64
    prefix_id: np.ndarray  # int64, -1: no shared prefix
    prefix_len: np.ndarray  # int64, tokens of the shared prefix (0 for none)

    def __len__(self) -> int:
        return len(self.arrival)

    def head(self, n: int) -> "Requests":
        return Requests(self.arrival[:n], self.prompt_len[:n], self.output_len[:n], self.prefix_id[:n],
                        self.prefix_len[:n])


def arrival_times(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """vLLM's arrival process, exactly as `kvlab bench serve` draws it (same seed, same offsets)."""
    rng = np.random.default_rng(seed)
    gaps = np.full(num, 1.0 / rate) if math.isinf(burstiness) else \
        rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (num / rate) / times[-1]
    return times


def draw(workload: Workload) -> Requests:
    """The requests of `workload`; identical seeds give identical requests."""
    workload.validate()
    if workload.trace is not None:
        return read_trace(workload.trace)
    n = workload.num_requests
    arrival = arrival_times(n, workload.rate, workload.burstiness, workload.seed)
    rng = np.random.default_rng(workload.seed + 1)
    suffix = workload.prompt.sample(rng, n)
    output = workload.output.sample(rng, n)
    shared = rng.random(n) < workload.prefix_fraction
    prefix_id = np.where(shared, rng.integers(0, workload.num_prefixes, size=n), -1).astype(np.int64)
    prefix_len = np.where(shared, workload.prefix_len, 0).astype(np.int64)
    return Requests(arrival, suffix + prefix_len, output, prefix_id, prefix_len)


def read_trace(path: str) -> Requests:
    """A JSONL trace of requests (one object a line), sorted by arrival."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append((float(row["arrival"]), int(row["prompt_len"]), int(row["output_len"]),
                             int(row.get("prefix_id", -1)), int(row.get("prefix_len", 0))))
            except (ValueError, KeyError, TypeError):
                raise FleetError(f"{path}:{number}: expected {{\"arrival\": s, \"prompt_len\": n, \"output_len\": m}}")
            if rows[-1][1] < 1 or rows[-1][2] < 1 or rows[-1][0] < 0 or rows[-1][4] > rows[-1][1]:
                raise FleetError(f"{path}:{number}: lengths must be positive and arrival non-negative")
    if not rows:
        raise FleetError(f"{path}: the trace holds no request")
    rows.sort(key=lambda r: r[0])
    cols = list(zip(*rows))
    return Requests(np.array(cols[0], dtype=np.float64), *(np.array(c, dtype=np.int64) for c in cols[1:]))
