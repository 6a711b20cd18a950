"""Findings of the GQA study, each sentence computed from results.json.

Noise yardsticks: for quality, the seed-to-seed range (max - min over seeds) of the variants
compared; a difference no larger than the larger range is "within seed noise". For speed,
the min..max over repeats; overlapping ranges are "within run-to-run noise".
"""

from __future__ import annotations


def findings(results: dict) -> list[str]:
    return (quality(results) + memory(results) + speed(results) + uptraining(results))


def _range(item: dict) -> float:
    return item["val_loss_max"] - item["val_loss_min"]


def quality(results: dict) -> list[str]:
    summary = results["summary"]
    if "mha" not in summary:
        return []
    base = summary["mha"]
    if base["seeds"] < 2:
        return ["- Quality: one seed per variant, so there is no seed spread to judge differences against."]
    ranked = sorted(summary, key=lambda name: summary[name]["val_loss_mean"])
    ranking = ", ".join(f"{n} {summary[n]['val_loss_mean']:.4f}" for n in ranked)
    out = [f"- Quality ranking by mean validation loss: {ranking}."]
    for name, item in summary.items():
        if name == "mha":
            continue
        diff = item["val_loss_mean"] - base["val_loss_mean"]
        noise = max(_range(item), _range(base))
        verdict = ("within seed noise" if abs(diff) <= noise else
                   f"{'worse' if diff > 0 else 'better'} than MHA by more than the seed range")
        out.append(f"- {name} vs mha: {diff:+.4f} nats/char ({diff / base['val_loss_mean']:+.1%}; seed ranges "
                   f"{_range(item):.4f} and {_range(base):.4f}): {verdict}.")
    return out


def memory(results: dict) -> list[str]:
    checks = []  # one per measurement: decode once per variant and batch, prefill per context
    for name, cells in (results.get("decode") or {}).items():
        checks += [(name, f"decode batch {b}", c["kv_bytes_formula"], c["kv_bytes_measured"]) for b, c in cells.items()]
    for name, rows in (results.get("cache_bytes_prefill") or {}).items():
        checks += [(name, f"prefill {r['context']}", r["kv_bytes_formula"], r["kv_bytes_measured"]) for r in rows]
    decode_checks = sum(1 for c in checks if c[1].startswith("decode"))
    out = []
    if checks:
        bad = [c for c in checks if c[2] != c[3]]
        if bad:
            out.append(f"- Cache bytes: **{len(bad)} of {len(checks)} checks disagree** between kvlab.plan and "
                       f"cache.nbytes(): {bad[:3]}.")
        else:
            out.append(f"- Cache bytes: kvlab.plan's formula and the bytes of the tensors the cache held agree exactly "
                       f"in all {len(checks)} measurements ({decode_checks} decodes: each variant at each batch, on seed 0's "
                       f"weights; {len(checks) - decode_checks} prefills at several contexts).")
    by_name = {v["variant"]: v["kv_bytes_per_token"] for v in results["variants"]}
    if "mha" in by_name:
        ratios = ", ".join(f"{n} {b / by_name['mha']:.3f}x ({b:,} B)" for n, b in by_name.items() if n != "mha")
        out.append(f"- Bytes per token against MHA's {by_name['mha']:,} B: {ratios}.")
    decode = (results.get("decode") or {}).get("mha", {})
    params = next((v["params"] for v in results["variants"] if v["variant"] == "mha"), None)
    if decode and params:
        weights = 4 * params
        sizes = "; ".join(f"batch {b}: {c['kv_bytes_measured'] / weights:.2f}x" for b, c in decode.items())
        out.append(f"- MHA's full cache at {next(iter(decode.values()))['context']:,} tokens against its fp32 "
                   f"weights ({weights:,} B): {sizes}. Per decode step the cache read grows from zero to that "
                   "size while the weights are read whole every step.")
    return out


def speed(results: dict) -> list[str]:
    decode = results.get("decode") or {}
    if "mha" not in decode:
        return []
    out = []
    for batch in sorted({b for cells in decode.values() for b in cells}, key=int):
        base = decode["mha"][batch]
        low, high = min(base["tokens_per_s_runs"]), max(base["tokens_per_s_runs"])
        parts = []
        for name, cells in decode.items():
            if name == "mha" or batch not in cells:
                continue
            cell = cells[batch]
            ratio = cell["tokens_per_s_median"] / base["tokens_per_s_median"]
            overlap = min(cell["tokens_per_s_runs"]) <= high and max(cell["tokens_per_s_runs"]) >= low
            parts.append(f"{name} {ratio:.2f}x{' (ranges overlap: within run-to-run noise)' if overlap else ''}")
        out.append(f"- Decode at batch {batch} ({base['tokens']} tokens, median of {len(base['tokens_per_s_runs'])}): "
                   f"mha {base['tokens_per_s_median']:,.0f} tok/s; against it {'; '.join(parts)}.")
    return out


def uptraining(results: dict) -> list[str]:
    records = results.get("uptraining") or []
    summary = results["summary"]
    scratch = {item["kv_heads"]: (name, item) for name, item in summary.items()}
    out = []
    for kv in sorted({r["kv_heads"] for r in records}, reverse=True):
        group = {r["method"]: r for r in records if r["kv_heads"] == kv}
        before = sorted(group, key=lambda m: group[m]["val_loss_before"])
        after = sorted(group, key=lambda m: group[m]["val_loss_after"])
        steps = next(iter(group.values()))["steps"]
        listed_before = ", ".join(f"{m} {group[m]['val_loss_before']:.3f}" for m in before)
        listed_after = ", ".join(f"{m} {group[m]['val_loss_after']:.3f}" for m in after)
        text = (f"- MHA -> {kv} KV head{'s' if kv > 1 else ''}, before uptraining: {listed_before}; "
                f"after {steps} steps: {listed_after}.")
        paper = ["mean", "first", "random"]
        text += (" The paper's order (mean-pool, then first-head, then random) "
                 f"{'holds' if before == paper else 'does not hold'} before uptraining and "
                 f"{'holds' if after == paper else 'does not hold'} after it.")
        if kv in scratch and "mean" in group and "first" in group:
            name, item = scratch[kv]
            gap = group["first"]["val_loss_after"] - group["mean"]["val_loss_after"]
            text += (f" First-head minus mean-pool after uptraining: {gap:+.4f} (positive: mean-pool better); "
                     f"{name}'s seed range is {_range(item):.4f}"
                     f"{', so this is within seed noise' if abs(gap) <= _range(item) else ''}.")
            best = group[after[0]]["val_loss_after"]
            text += (f" Best uptrained ({after[0]}) {best:.4f} against {name} trained from scratch "
                     f"{item['val_loss_mean']:.4f} (seed mean).")
        out.append(text)
    control = results.get("uptrain_control")
    if control:
        change = control["val_loss_after"] - control["val_loss_before"]
        text = (f"- Control: MHA itself, fine-tuned the same {control['steps']} steps on the same schedule, went "
                f"{control['val_loss_before']:.4f} -> {control['val_loss_after']:.4f} ({change:+.4f}). ")
        if change < 0:
            text += "That much of any uptrained model's gain is extra training rather than recovery from conversion."
        else:
            text += ("Extra steps alone did not lower a trained model's loss here (its loss rose while the learning "
                     "rate re-warmed to the uptraining peak), so the uptrained models' drops are recovery from "
                     "conversion, not extra training.")
        out.append(text)
    return out
