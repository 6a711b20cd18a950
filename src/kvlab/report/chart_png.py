"""The chart as a static PNG (matplotlib), for reports and slides: same lines as the page."""

from __future__ import annotations

from typing import Any, Optional


GIB = 2**30


def _gib(terms: list[list[Optional[int]]], tokens: int, batch: int) -> float:
    return batch * sum(per_token * (tokens if window is None else min(tokens, window)) + (fixed if tokens else 0)
                       for per_token, window, fixed in terms) / GIB


def write_chart_png(data: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = data["start"]
    bits, batch, context = str(start["bits"]), start["batch"], start["context"]
    crossings = data.get("crossings", {})
    x_max = max(2 * context, data.get("max_context") or 0, 1024, 4 * (crossings.get("chosen") or 0))
    xs = [int(64 * (x_max / 64) ** (i / 200)) for i in range(201)]
    lines = [(f"MHA ({data['q_heads']} KV heads)", data["variants"][str(data["q_heads"])][bits], (0, (8, 5)), "#c0392b"),
             (f"chosen ({start['kv_heads']} KV heads)", data["variants"][str(start["kv_heads"])][bits], "-", "#1f5fa8"),
             ("MQA (1 KV head)", data["variants"]["1"][bits], ":", "#27864a")]
    if "mla" in data:
        lines.append(("MLA (latent)", data["mla"][bits], "-.", "#8e44ad"))
    figure, axes = plt.subplots(figsize=(9, 5), dpi=110)
    for label, terms, style, color in lines:
        axes.plot(xs, [_gib(terms, x, batch) for x in xs], linestyle=style, color=color, label=label, linewidth=2)
    axes.axhline(start["budget_gib"], color="#e67e22", label=f"budget {start['budget_gib']:.2f} GiB")
    chosen = data["variants"][str(start["kv_heads"])][bits]
    axes.plot([context], [_gib(chosen, context, batch)], "o", color="#1f5fa8")
    for name, color in (("chosen", "#1f5fa8"), ("mha", "#c0392b")):
        tokens = crossings.get(name)
        if tokens and 64 <= tokens <= x_max and (name == "chosen" or start["kv_heads"] != data["q_heads"]):
            axes.plot([tokens], [start["budget_gib"]], "o", markerfacecolor="white", markeredgecolor=color,
                      markersize=8)
            axes.annotate(f"{'stops fitting after' if name == 'chosen' else 'MHA stops at'} {tokens:,}",
                          (tokens, start["budget_gib"]), textcoords="offset points",
                          xytext=(8, -16) if name == "chosen" else (-8, 8), ha="left" if name == "chosen" else "right",
                          color=color, fontsize=9)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel(f"context (tokens), batch {batch}")
    axes.set_ylabel("total KV cache (GiB)")
    axes.set_title(f"{data['model']}: KV cache at {bits}-bit")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
