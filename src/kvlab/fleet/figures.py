"""PNG figures of fleet runs (matplotlib, headless): tails and cards against rate, KV use over time."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from kvlab.files import write_atomic


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> str:
    write_atomic(path, lambda handle: fig.savefig(handle, format="png", dpi=110, bbox_inches="tight"))
    return str(path)


def latency_vs_rate(rows: Sequence[dict], path: Path, title: str, slo: Optional[dict] = None) -> str:
    """rows: {"rate", "ttft_ms", "tpot_ms", optional "cards_needed"}: p50/p95/p99 against rate."""
    plt = _plt()
    panels = 3 if any("cards_needed" in r for r in rows) else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8))
    rates = [r["rate"] for r in rows]
    for ax, metric, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for p, style in (("p50", "-o"), ("p95", "-s"), ("p99", "-^")):
            ax.plot(rates, [r[metric][p] for r in rows], style, label=p, markersize=4)
        name = metric.split("_")[0]
        if slo and name in slo:
            ax.axhline(slo[name], color="red", linestyle="--", linewidth=1, label=f"SLO {slo[name]:g} ms")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if panels == 3:
        ax = axes[2]
        ax.plot(rates, [r.get("cards_needed") for r in rows], "-o", color="black")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("cards to meet the SLO")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    out = _save(fig, path)
    plt.close(fig)
    return out


def kv_timeline(timeline: Sequence[tuple], path: Path, title: str) -> str:
    """Pool use (mean over replicas, and the fullest), running/waiting requests and preemptions over time."""
    plt = _plt()
    data = np.array(timeline, dtype=float)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    if len(data):
        order = np.argsort(data[:, 0])
        data = data[order]
        edges = np.linspace(data[0, 0], data[-1, 0] + 1e-9, 200)
        which = np.digitize(data[:, 0], edges)
        mids, mean_use, max_use, running, waiting = [], [], [], [], []
        for b in np.unique(which):
            rows = data[which == b]
            mids.append(rows[:, 0].mean())
            mean_use.append(rows[:, 2].mean() * 100)
            max_use.append(rows[:, 2].max() * 100)
            running.append(rows[:, 3].mean())
            waiting.append(rows[:, 4].mean())
        top.plot(mids, mean_use, label="mean over replicas")
        top.plot(mids, max_use, label="fullest replica", alpha=0.6)
        bottom.plot(mids, running, label="running (mean per replica)")
        bottom.plot(mids, waiting, label="waiting (mean per replica)")
        first = data[data[:, 1] == data[0, 1]]
        if first[:, 5].max() > 0:
            ax2 = bottom.twinx()
            ax2.plot(first[:, 0], first[:, 5], color="red", alpha=0.5, linewidth=0.8)
            ax2.set_ylabel(f"preemptions, replica {int(data[0, 1])} (cumulative)", color="red", fontsize=8)
    top.set_ylabel("KV blocks in use (%)")
    top.set_ylim(0, 105)
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    bottom.set_xlabel("simulated time (s)")
    bottom.set_ylabel("requests")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    out = _save(fig, path)
    plt.close(fig)
    return out
