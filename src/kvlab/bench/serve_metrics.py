"""Serving metrics with vLLM's definitions and JSON names (vllm/benchmarks/serve.py, calculate_metrics).

Over the successful requests: TTFT (send to first token chunk), TPOT ((E2EL - TTFT) /
(output tokens - 1), only for requests with more than one token), ITL (every gap between
token chunks, pooled over requests), E2EL (send to last token). Throughputs divide by the
whole run's wall time. Goodput counts the requests meeting every given SLO (a one-token
request's TPOT is 0 there, as in vLLM). Means, medians, standard deviations and percentiles
are numpy's (linear interpolation), in milliseconds: mean_ttft_ms, median_ttft_ms,
std_ttft_ms, p99_ttft_ms, ...
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import numpy as np

from kvlab.bench.serve_client import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                 "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def percentile_name(p: float) -> str:
    """vLLM's key: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p) if int(p) == p else p}"


def output_tokens(out: RequestOutput, tokenizer) -> tuple[int, str]:
    """Tokens one request produced, and whose count it is: the server's usage, the tokenizer, or the chunks."""
    if out.output_tokens:
        return out.output_tokens, "server usage"
    if tokenizer is not None:
        return len(tokenizer.encode(out.generated_text, add_bos=False)), "tokenizer"
    return out.chunks, "stream chunks"


def peak_output_rate(outputs: Sequence[RequestOutput]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s (token chunks in the busiest whole second) and max_concurrent_requests."""
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0, 0
    t0 = min(o.start_time for o in done)
    seconds = int(np.ceil(max(o.start_time + o.latency for o in done) - t0)) + 1
    per_second = np.zeros(seconds)
    for o in done:
        t = o.start_time + o.ttft
        for when in [t] + list(np.cumsum(o.itl) + t):
            per_second[min(int(when - t0), seconds - 1)] += 1
    events = sorted([(o.start_time, 1) for o in done] + [(o.start_time + o.latency, -1) for o in done])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return float(per_second.max()), peak


def calculate_metrics(outputs: Sequence[RequestOutput], duration: float, tokenizer, percentile_metrics: Sequence[str],
                      percentiles: Sequence[float], goodput: Optional[dict[str, float]] = None) -> dict:
    """The summary dict: vLLM's keys, plus kvlab's `cancelled`, `status_counts` and token-count source."""
    ttfts, tpots, all_tpots, itls, e2els, out_lens = [], [], [], [], [], []
    total_input, sources = 0, Counter()
    for o in outputs:
        if not o.success:
            continue
        n, source = output_tokens(o, tokenizer)
        sources[source] += 1
        out_lens.append(n)
        total_input += o.prompt_len
        tpot = (o.latency - o.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(o.ttft)
        itls += o.itl
        e2els.append(o.latency)
    completed = len(out_lens)
    cancelled = sum(1 for o in outputs if o.cancelled)
    good = None
    if goodput:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        slos = [(per_request[name], limit / 1000) for name, limit in goodput.items()]
        good = sum(1 for i in range(completed) if all(values[i] <= limit for values, limit in slos))
    peak_rate, peak_concurrency = peak_output_rate(outputs)
    total_output = sum(out_lens)
    result = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed - cancelled,
        "cancelled": cancelled,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "request_goodput": None if good is None else good / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_rate,
        "max_concurrent_requests": peak_concurrency,
        "status_counts": dict(sorted(Counter(str(o.status) for o in outputs if not o.cancelled).items())),
        "output_tokens_counted_by": ", ".join(f"{k} ({v})" for k, v in sources.most_common()) or None,
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in percentile_metrics:
        data = np.asarray(values[name] or [0.0]) * 1000
        result[f"mean_{name}_ms"] = float(np.mean(data))
        result[f"median_{name}_ms"] = float(np.median(data))
        result[f"std_{name}_ms"] = float(np.std(data))
        for p in percentiles:
            result[f"{percentile_name(p)}_{name}_ms"] = float(np.percentile(data, p))
    return result
