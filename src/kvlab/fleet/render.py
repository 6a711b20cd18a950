"""The rich summary `kvlab fleet` prints (the --json object is the same data)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _ms(stats: dict) -> str:
    return " / ".join("-" if stats[p] is None else f"{stats[p]:,.1f}" for p in ("p50", "p95", "p99"))


def render(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    r, rep = result["result"], result["replica"]
    w = result["workload"]
    title = (f"{result['model']} on {result['card'] or 'the calibrated engine'}: {w['rate']:g} req/s, "
             f"prompt {w['prompt']}, output {w['output']}")
    table = Table(title=title, show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("fleet", f"{r['replicas']} replicas x {rep['cards']} card(s) = {r['cards']} cards "
                           f"({r['router']}, {r['simulator']} simulator)")
    table.add_row("per replica", f"{rep['num_blocks']:,} KV blocks of {rep['block_size']} = {rep['kv_tokens']:,} "
                                 f"tokens, {rep['max_num_seqs']} seats, {rep['max_num_batched_tokens']} tokens/step")
    table.add_row("requests", f"{r['completed']:,} of {r['requests']:,} completed, {r['rejected']} rejected, "
                              f"{r['preemptions']:,} preemptions")
    if r.get("speculative"):
        s = r["speculative"]
        measured = "-" if s["mean_tokens_per_step"] is None else f"{s['mean_tokens_per_step']:.2f}"
        table.add_row("speculative", f"draft {s['draft']}, k={s['num_speculative_tokens']}, acceptance "
                                     f"{s['acceptance_rate']:g}: {s['expected_tokens_per_step']:.2f} tokens per "
                                     f"step expected, {measured} drawn")
    table.add_row("TTFT p50/p95/p99 ms", _ms(r["ttft_ms"]))
    table.add_row("TPOT p50/p95/p99 ms", _ms(r["tpot_ms"]))
    table.add_row("E2EL p50/p95/p99 ms", _ms(r["e2el_ms"]))
    table.add_row("throughput", f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:,.0f} output tok/s")
    if "kv_usage" in r:
        table.add_row("KV use", f"mean {r['kv_usage']['mean']:.0%}, p95 {r['kv_usage']['p95']:.0%}, "
                                f"max {r['kv_usage']['max']:.0%}; prefix hit rate {r['prefix_cache_hit_rate']:.0%}")
    if "slo" in r:
        slo = " ".join(f"{k}:{v:g}ms" for k, v in r["slo"].items())
        table.add_row("SLO " + slo, f"{'met' if r['meets_slo'] else 'MISSED'} at p95; goodput {r['goodput']:.2f} "
                                    f"req/s ({r['good_fraction']:.0%} of requests)")
    if "min_cards" in result:
        m = result["min_cards"]
        tried = ", ".join(f"{t['replicas']}xTP{t.get('cards_per_replica', rep['cards'])} "
                          f"{'met' if t['meets_slo'] else 'missed'}" for t in m["trials"])
        table.add_row("fewest cards for the SLO", f"{m['cards']} ({m['replicas']} replicas of TP{rep['cards']}); "
                                                  f"tried {tried}")
    if "cost" in r:
        c = r["cost"]
        line = f"${c['dedicated_per_mtok']:.3f} per million output tokens dedicated (${c['fleet_per_hour']:.2f}/h)"
        if "price_per_mtok" in c:
            line += (f"; pay-per-token ${c['price_per_mtok']:g}: {c['cheaper']} is cheaper here, break-even at "
                     f"{c['break_even_rate']:.2f} req/s for this fleet")
        table.add_row("cost", line)
    table.add_row("simulated", f"{r['simulated_seconds']:,.0f} s of traffic, {r['engine_steps']:,} engine steps in "
                               f"{r['wall_seconds']:.1f} s")
    console.print(table)
    for row in result.get("sweep", []):
        console.print(f"  rate {row['rate']:g}: {row['replicas']} replicas, TTFT p95 {row['ttft_ms']['p95']:.0f} ms, "
                      f"TPOT p95 {row['tpot_ms']['p95']:.1f} ms")
    for path in result.get("figures", []):
        console.print(f"  wrote {path}")
