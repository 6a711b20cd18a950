"""/metrics: vLLM's metric names under a `kvlab:` prefix, a `vllm:` one, or both (`--metric-names`).

Both by default, so that a dashboard built for vLLM (its `vllm:` queries) works unchanged
beside kvlab's own. vLLM's exporter writes the same names under `vllm:` (checked against
vLLM 0.32's), so the families below are written once per prefix.

Gauges and counters are read from the engine's own counts when Prometheus scrapes (so they
can never drift from what the engine did); latency histograms are observed as requests finish.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


METRIC_NAMES = ("both", "kvlab", "vllm")


def prefixes(metric_names: str) -> tuple[str, ...]:
    if metric_names not in METRIC_NAMES:
        raise ValueError(f"metric_names must be one of {', '.join(METRIC_NAMES)}, got {metric_names!r}")
    return ("kvlab", "vllm") if metric_names == "both" else (metric_names,)


class EngineCollector:
    def __init__(self, engine, model_name: str, prefix: str = "kvlab") -> None:
        self.engine, self.model_name, self.prefix = engine, model_name, prefix

    def collect(self):
        e, labels, prefix = self.engine, ["model_name"], self.prefix

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=labels)
            g.add_metric([self.model_name], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"{prefix}:{name}", doc, labels=labels)
            c.add_metric([self.model_name], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", e.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted.", e.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).", e.blocks.usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", e.blocks.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", e.blocks.prefix_hits)
        yield counter("num_preemptions", "Requests preempted (recomputed) for lack of KV blocks.",
                      e.scheduler.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens received.", e.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", e.generation_tokens_total)
        if e.speculative is not None:  # vLLM's spec_decode metrics
            s = e.spec_stats
            yield counter("spec_decode_num_drafts", "Speculative proposals checked.", s.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens)
            per = CounterMetricFamily(f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position.", labels=["model_name", "position"])
            for position, count in enumerate(s.accepted_per_position):
                per.add_metric([self.model_name, str(position)], count)
            yield per


class Metrics:
    def __init__(self, engine, model_name: str, metric_names: str = "both") -> None:
        self.registry = CollectorRegistry()
        self.histograms = []
        common = dict(labelnames=["model_name"], registry=self.registry, buckets=LATENCY_BUCKETS)
        for prefix in prefixes(metric_names):
            self.registry.register(EngineCollector(engine, model_name, prefix))
            self.histograms.append((
                Histogram(f"{prefix}:time_to_first_token_seconds", "Time to first token.", **common),
                Histogram(f"{prefix}:inter_token_latency_seconds", "Time between consecutive tokens.", **common),
                Histogram(f"{prefix}:e2e_request_latency_seconds", "Arrival to last token.", **common)))
        self.model_name = model_name
        engine.on_finish.append(self.observe)

    def observe(self, seq) -> None:
        """A finished request's latencies (aborted ones too: their tokens were real)."""
        name = self.model_name
        if seq.first_token_time is not None:
            gaps = [after - before for before, after in zip(seq.token_times, seq.token_times[1:])]
            for ttft, itl, e2e in self.histograms:
                ttft.labels(name).observe(seq.first_token_time - seq.arrival)
                for gap in gaps:
                    itl.labels(name).observe(gap)
                e2e.labels(name).observe(seq.last_token_time - seq.arrival)
