"""The "Serving Benchmark Result" table (one column per concurrency level) and the --plot figure."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.table import Table

from kvlab.bench.serve_metrics import METRIC_TITLES, percentile_name


def _level_name(run: dict) -> str:
    c = run["max_concurrency"]
    return f"concurrency {c}" if c is not None else "no cap"


def summary_table(runs: Sequence[dict], percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> Table:
    """Rows as vLLM prints them; columns are the --max-concurrency levels."""
    table = Table(title="Serving Benchmark Result")
    table.add_column("metric", style="bold")
    for run in runs:
        table.add_column(_level_name(run), justify="right")

    def row(label: str, key: str, fmt: str = "{:,.2f}") -> None:
        table.add_row(label, *("-" if run.get(key) is None else fmt.format(run[key]) for run in runs))
    row("Successful requests", "completed", "{:,}")
    row("Failed requests", "failed", "{:,}")
    if any(run.get("cancelled") for run in runs):
        row("Cancelled by the client", "cancelled", "{:,}")
    if runs and runs[0]["request_rate"] != "inf":
        row("Request rate configured (RPS)", "request_rate")
    row("Benchmark duration (s)", "duration")
    row("Total input tokens", "total_input_tokens", "{:,}")
    row("Total generated tokens", "total_output_tokens", "{:,}")
    row("Request throughput (req/s)", "request_throughput")
    if any(run.get("request_goodput") is not None for run in runs):
        row("Request goodput (req/s)", "request_goodput")
    row("Output token throughput (tok/s)", "output_throughput")
    row("Peak output token throughput (tok/s)", "max_output_tokens_per_s")
    row("Peak concurrent requests", "max_concurrent_requests", "{:,}")
    row("Total token throughput (tok/s)", "total_token_throughput")
    for name in percentile_metrics:
        short, title = METRIC_TITLES[name]
        table.add_section()
        table.add_row(f"[italic]{title}[/italic]", *("" for _ in runs))
        row(f"Mean {short} (ms)", f"mean_{name}_ms")
        row(f"Median {short} (ms)", f"median_{name}_ms")
        for p in percentiles:
            row(f"{percentile_name(p).upper()} {short} (ms)", f"{percentile_name(p)}_{name}_ms")
    return table


def print_summary(runs: Sequence[dict], percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> None:
    Console(width=max(100, 44 + 18 * len(runs))).print(summary_table(runs, percentile_metrics, percentiles))


def plot(runs: Sequence[dict], path: str, percentile_metrics: Sequence[str], percentiles: Sequence[float],
         title: str) -> None:
    """Latency (median and each percentile, per metric) and throughput against the concurrency levels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [run["max_concurrency"] or run["completed"] + run["failed"] + run["cancelled"] for run in runs]
    fig, (lat, tput) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in percentile_metrics:
        short = METRIC_TITLES[name][0]
        line, = lat.plot(xs, [run[f"median_{name}_ms"] for run in runs], marker="o", label=f"{short} median")
        for p, style in zip(percentiles, ("--", ":", "-.")):
            lat.plot(xs, [run[f"{percentile_name(p)}_{name}_ms"] for run in runs], style, marker=".",
                     color=line.get_color(), label=f"{short} {percentile_name(p)}")
    lat.set(xlabel="max concurrency", ylabel="ms", title="latency", xscale="log", yscale="log")
    lat.legend(fontsize=7, ncol=2, loc="upper left")
    tput.plot(xs, [run["output_throughput"] for run in runs], marker="o", label="output tok/s")
    tput.plot(xs, [run["total_token_throughput"] for run in runs], marker="s", label="total tok/s")
    tput.set(xlabel="max concurrency", ylabel="tokens/s", title="throughput", xscale="log")
    tput.legend(fontsize=8)
    from matplotlib.ticker import NullFormatter
    for ax in (lat, tput):
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
