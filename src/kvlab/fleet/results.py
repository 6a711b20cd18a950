"""A fleet run's figures: latency percentiles, throughput, goodput, KV use, cards and cost.

Definitions follow `kvlab bench serve` (vLLM's): TTFT is arrival to first token, TPOT is
(E2EL - TTFT) / (output tokens - 1) over requests with more than one token, E2EL arrival to
last token; throughput divides by the span from the first arrival to the last finish. A request
meets the SLO when its own TTFT and TPOT are within the limits (goodput, as vLLM's); the fleet
meets it when the p95 of TTFT and of TPOT are within them (the tail an SLA measures).
Cost: dedicated cards bill every hour of the run whether busy or not, so a million output tokens
cost cards x price x hours / (output tokens / 1e6); pay-per-token bills only the tokens, so it
wins below the break-even rate at which the fleet's hourly bill equals the tokens' price.
With a draft model, TPOT and ITL are per token of multi-token steps (a step emitting 3 tokens
counts 3), and `speculative` gives the settings and what was drawn: mean tokens per verifying
step (1 + accepted / verifications, a little below the closed form where answers end early and
fewer than k drafts fit) and accepted_per_drafted, vLLM's "acceptance rate" metric, which is
below the per-token rate a because drafts after the first rejection count as drafted.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvlab.fleet.fleet import FleetRun

PERCENTILES = (50, 95, 99)


def _stats(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = values * 1000
    return {"mean": float(np.mean(ms)), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def per_request(run: FleetRun) -> dict[str, np.ndarray]:
    r, o = run.requests, run.outcomes
    done = ~np.isnan(o.finish)
    ttft = (o.first_token - r.arrival)[done]
    e2el = (o.finish - r.arrival)[done]
    n = r.output_len[done]
    many = n > 1
    tpot_all = np.where(many, (e2el - ttft) / np.maximum(n - 1, 1), 0.0)
    return {"done": done, "ttft": ttft, "e2el": e2el, "tpot": tpot_all[many], "tpot_all": tpot_all, "n": n}


def summarise(run: FleetRun, cards_per_replica: int, slo: Optional[dict[str, float]] = None,
              price_per_card_hour: Optional[float] = None, price_per_mtok: Optional[float] = None) -> dict:
    r, o = run.requests, run.outcomes
    m = per_request(run)
    done = m["done"]
    completed = int(done.sum())
    span = float(np.nanmax(o.finish) - r.arrival[0]) if completed else 0.0
    out_tokens = int(m["n"].sum())
    in_tokens = int(r.prompt_len[done].sum())
    cards = run.replicas * cards_per_replica
    result: dict = {
        "aborted": run.aborted,
        "requests": len(r), "completed": completed, "rejected": int(o.rejected.sum()),
        "replicas": run.replicas, "cards_per_replica": cards_per_replica, "cards": cards,
        "simulator": run.simulator, "router": run.router, "engine_steps": o.steps,
        "simulated_seconds": span, "wall_seconds": run.wall_seconds,
        "request_throughput": completed / span if span else 0.0,
        "output_throughput": out_tokens / span if span else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / span if span else 0.0,
        "ttft_ms": _stats(m["ttft"]), "tpot_ms": _stats(m["tpot"]), "e2el_ms": _stats(m["e2el"]),
        "preemptions": int(o.preemptions.sum()),
        "prefix_cache_hit_rate": float(o.cached_tokens[done].sum() / max(1, in_tokens)),
        "peak_kv_blocks_used": run.peak_blocks_used,
    }
    if run.speculation is not None:  # the settings, and what the draws gave (vLLM's SpecStats definitions)
        spec = run.speculation.describe()
        spec.pop("draft_cost")
        spec.update(num_drafts=o.num_drafts, num_draft_tokens=o.num_draft_tokens,
                    num_accepted_tokens=o.num_accepted_tokens,
                    accepted_per_drafted=o.num_accepted_tokens / o.num_draft_tokens if o.num_draft_tokens else None,
                    mean_tokens_per_step=1 + o.num_accepted_tokens / o.num_drafts if o.num_drafts else None)
        result["speculative"] = spec
    if o.timeline:
        usage = np.array([row[2] for row in o.timeline])
        result["kv_usage"] = {"mean": float(usage.mean()), "p95": float(np.percentile(usage, 95)),
                              "max": float(usage.max())}
    if slo:
        ok = np.ones(completed, bool)
        if "ttft" in slo:
            ok &= m["ttft"] <= slo["ttft"] / 1000
        if "tpot" in slo:
            ok &= m["tpot_all"] <= slo["tpot"] / 1000
        if "e2el" in slo:
            ok &= m["e2el"] <= slo["e2el"] / 1000
        result["slo"] = dict(slo)
        result["goodput"] = float(ok.sum() / span) if span else 0.0
        result["good_fraction"] = float(ok.mean()) if completed else 0.0
        result["meets_slo"] = meets(result, slo)
    if price_per_card_hour:
        hours = span / 3600
        bill = cards * price_per_card_hour * hours
        cost = {"price_per_card_hour": price_per_card_hour, "fleet_per_hour": cards * price_per_card_hour,
                "dedicated_per_mtok": bill / (out_tokens / 1e6) if out_tokens else None}
        if price_per_mtok and out_tokens:
            per_request_tokens = out_tokens / max(1, completed)
            cost["price_per_mtok"] = price_per_mtok
            cost["break_even_rate"] = cards * price_per_card_hour / (per_request_tokens * 3600 / 1e6 * price_per_mtok)
            cost["cheaper"] = "dedicated" if cost["dedicated_per_mtok"] <= price_per_mtok else "pay-per-token"
        result["cost"] = cost
    return result


def meets(result: dict, slo: dict[str, float]) -> bool:
    """p95 TTFT and p95 TPOT (and E2EL) within the SLO, nothing rejected and everything completed."""
    if result["aborted"] or result["completed"] < result["requests"] or result["completed"] == 0:
        return False
    for name in ("ttft", "tpot", "e2el"):
        if name in slo and (result[f"{name}_ms"]["p95"] or 0) > slo[name]:
            return False
    return True
