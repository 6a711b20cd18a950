"""The GQA study's figures, drawn from results.json alone (so any saved result can be redrawn).

The cache-bytes figure draws kvlab.plan's curve for each variant's model config; the caller
passes `plan_spec` (config dict -> ModelSpec: kvlab.nn.config.plan_spec), since report/ renders
and never imports the model code itself.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"mha": "#1f77b4", "mqa": "#d62728", "mla": "#9467bd"}
METHOD_COLOURS = {"mean": "#2ca02c", "first": "#ff7f0e", "random": "#7f7f7f"}
CONTEXTS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def colour(name: str) -> str:
    return COLOURS.get(name, "#2ca02c")


def write_figures(results: dict, out: Path, plan_spec: Callable) -> dict[str, str]:
    """Draw every figure the results allow; returns {figure: file name}."""
    out.mkdir(parents=True, exist_ok=True)
    drawn = {}
    for name, draw in (("val_loss", val_loss), ("training", training), ("cache_bytes", partial(cache_bytes, plan_spec=plan_spec)),
                       ("decode_speed", decode_speed), ("uptraining", uptraining)):
        figure = draw(results)
        if figure is not None:
            figure.savefig(out / f"{name}.png", dpi=110, bbox_inches="tight")
            plt.close(figure)
            drawn[name] = f"{name}.png"
    return drawn


def val_loss(results: dict):
    runs, variants = results["runs"], results["variants"]
    if not runs:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    summary = results["summary"]
    for v in variants:
        item = summary.get(v["variant"])
        if item is None:
            continue
        losses = [r["val_loss"] for r in runs if r["variant"] == v["variant"]]
        mean, low, high = item["val_loss_mean"], item["val_loss_min"], item["val_loss_max"]
        if v["kv_heads"] is None:
            left.axhspan(low, high, color=colour(v["variant"]), alpha=0.15)
            left.axhline(mean, color=colour(v["variant"]), ls="--", label=f"{v['variant']} (latent cache)")
        else:
            x = v["kv_heads"]
            left.scatter([x] * len(losses), losses, s=14, color=colour(v["variant"]), alpha=0.6)
            left.errorbar([x], [mean], yerr=[[mean - low], [high - mean]], fmt="o", capsize=5, ms=7,
                          color=colour(v["variant"]), label=f"{v['variant']} ({x} KV heads)")
        bytes_per_token = v["kv_bytes_per_token"]
        right.errorbar([bytes_per_token], [mean], yerr=[[mean - low], [high - mean]], fmt="o", capsize=5, ms=7,
                       color=colour(v["variant"]), label=v["variant"])
        right.annotate(v["variant"], (bytes_per_token, mean), textcoords="offset points", xytext=(6, 6))
    left.set_xscale("log", base=2)
    left.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    left.set(xlabel="KV heads (8 query heads)", ylabel="validation loss (nats/char)",
             title="Validation loss: seed means, bars = min..max over seeds")
    left.legend(fontsize=8)
    right.set_xscale("log", base=2)
    right.set(xlabel="KV-cache bytes per token (all layers, fp32)", ylabel="validation loss (nats/char)",
              title="Quality against cache size")
    return fig


def training(results: dict):
    runs = [r for r in results["runs"] if r.get("history")]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        steps = [h["step"] for h in r["history"]]
        ax.plot(steps, [h["val_loss"] for h in r["history"]], color=colour(r["variant"]), alpha=0.8,
                ls="-" if r["seed"] == results["seeds"][0] else ":", label=f"{r['variant']} s{r['seed']}")
    ax.set(xlabel="step", ylabel="validation loss (eval batches)", title="Training curves")
    ax.legend(fontsize=7, ncol=2)
    return fig


def cache_bytes(results: dict, plan_spec: Callable):
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    formats = cache_formats("auto", model_dtype="fp32")
    prefill = results.get("cache_bytes_prefill") or {}
    decode = results.get("decode") or {}
    measured = {p["context"] for rows in prefill.values() for p in rows}
    measured |= {c["context"] for cells in decode.values() for c in cells.values()}
    contexts = sorted(set(CONTEXTS) | measured)
    for v in results["variants"]:
        spec = plan_spec(v["config"])
        left.plot(contexts, [kv_bytes_per_sequence(spec, c, formats) for c in contexts], color=colour(v["variant"]),
                  label=f"{v['variant']} (plan)")
        points = [(p["context"], p["kv_bytes_measured"]) for p in prefill.get(v["variant"], [])]
        points += [(c["context"], c["kv_bytes_measured"] // int(b)) for b, c in decode.get(v["variant"], {}).items()]
        if points:
            left.scatter(*zip(*points), color=colour(v["variant"]), marker="x", s=30)
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set(xlabel="context (tokens)", ylabel="KV-cache bytes, one sequence",
             title="Cache bytes: lines = kvlab.plan, x = cache.nbytes()")
    left.legend(fontsize=8)
    names = [v["variant"] for v in results["variants"]]
    values = [v["kv_bytes_per_token"] for v in results["variants"]]
    bars = right.bar(names, values, color=[colour(n) for n in names])
    right.bar_label(bars, labels=[f"{x:,}" for x in values], fontsize=8)
    right.set(ylabel="bytes per token (all layers)", title="Cache bytes per token by variant")
    return fig


def decode_speed(results: dict):
    decode = results.get("decode")
    if not decode:
        return None
    batches = sorted({int(b) for cells in decode.values() for b in cells})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        names = [n for n in decode if str(batch) in decode[n]]
        medians = [decode[n][str(batch)]["tokens_per_s_median"] for n in names]
        runs = [decode[n][str(batch)]["tokens_per_s_runs"] for n in names]
        errors = [[m - min(r) for m, r in zip(medians, runs)], [max(r) - m for m, r in zip(medians, runs)]]
        bars = ax.bar(names, medians, yerr=errors, capsize=5, color=[colour(n) for n in names])
        ax.bar_label(bars, labels=[f"{m:,.0f}" for m in medians], fontsize=8, label_type="center")
        tokens = decode[names[0]][str(batch)]["tokens"]
        ax.set(ylabel="tokens/s (median; bars = min..max)", title=f"Decode {tokens} tokens, batch {batch}")
    return fig


def uptraining(results: dict):
    records = results.get("uptraining") or []
    if not records:
        return None
    targets = sorted({r["kv_heads"] for r in records}, reverse=True)
    fig, axes = plt.subplots(1, len(targets), figsize=(5.5 * len(targets), 4), squeeze=False)
    scratch = {}
    for r in results["runs"]:
        if r.get("history"):
            scratch.setdefault(r["kv_heads"], []).append(r["history"][-1]["val_loss"])
    control = results.get("uptrain_control")
    for ax, kv in zip(axes[0], targets):
        for r in (r for r in records if r["kv_heads"] == kv):
            curve = r["curve"]
            ax.plot([p["step"] for p in curve], [p["val_loss"] for p in curve], marker="o", ms=3,
                    color=METHOD_COLOURS.get(r["method"], "black"), label=r["method"])
        if control:
            curve = control["curve"]
            ax.plot([p["step"] for p in curve], [p["val_loss"] for p in curve], color="black", lw=1,
                    label="MHA continued (control)")
        if kv in scratch:
            level = sum(scratch[kv]) / len(scratch[kv])
            ax.axhline(level, color="black", ls="--", lw=1, label=f"trained with {kv} KV heads from scratch")
        ax.set(xlabel="uptraining step", ylabel="validation loss (eval batches)",
               title=f"MHA -> {kv} KV head{'s' if kv > 1 else ''}")
        ax.legend(fontsize=8)
    return fig
