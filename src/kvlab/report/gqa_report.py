"""The GQA study's README: set-up, findings computed from the numbers, tables, figures, samples.

Every sentence under "Findings" is derived from results.json by the rules below, so a rerun
that comes out differently says something different. A hand-written `discussion.md` in the
report folder, if present, is included verbatim (it survives regeneration).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvlab.plan.units import exact_and_binary
from kvlab.report.gqa_figures import write_figures
from kvlab.report.markdown import table

SETUP = "bash scripts/install.sh   # or: pip install -e \".[lab]\" (torch, numpy, matplotlib, tqdm)"


def write_report(results: dict, out: Path, plan_spec: Callable) -> Path:
    """README.md and the figures; `plan_spec` (config dict -> ModelSpec) draws kvlab.plan's cache curves."""
    out = Path(out)
    figures = write_figures(results, out, plan_spec)
    discussion = out / "discussion.md"
    text = render(results, figures, discussion.read_text(encoding="utf-8") if discussion.exists() else None)
    path = out / "README.md"
    path.write_text(text, encoding="utf-8")
    return path


def ratio(results: dict, name: str, base: str) -> str:
    params = {v["variant"]: v["params"] for v in results["variants"]}
    return f"{params[name] / params[base]:.3f}x" if name in params and base in params else "n/a"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def code_and_machine(prov: dict) -> dict:
    """What the report prints of a study's provenance, from either schema it has been written in.

    New studies store kvlab.bench.provenance's record (git_commit, machine.cores, torch_version);
    results.json files written before that carry the study's own (git{commit, changed_files},
    machine.cpu_count, versions{}), and must still render byte for byte.
    """
    machine = prov["machine"]
    if "git" in prov:  # the study's own schema, before the one provenance
        git = prov["git"]
        return {"commit": git.get("commit"), "changed": git.get("changed_files") or [],
                "dirty_src": git.get("dirty_src"), "versions": prov["versions"], "cores": machine["cpu_count"],
                "load_now": prov["load_average_now"]}
    versions = {"python": prov.get("python_version"), "kvlab": prov.get("kvlab_version"),
                "torch": prov.get("torch_version"), "transformers": prov.get("transformers_version")}
    commit = prov.get("git_commit")
    return {"commit": commit.removesuffix("+dirty") if commit else None, "changed": prov.get("git_dirty_files") or [],
            "dirty_src": False, "versions": versions, "cores": machine["cores"], "load_now": prov.get("load_average")}


def stages(prov: dict) -> str:
    parts = [f"{name} {minutes(sec)}" for name, sec in (prov.get("stage_seconds") or {}).items() if sec]
    return f": {', '.join(parts)}" if parts else ""


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def render(results: dict, figures: dict, discussion: str | None = None) -> str:
    p, prov = results["preset"], results["provenance"]
    lines = [f"# GQA study: MHA, GQA, MQA and MLA character models on Tiny Shakespeare ({p['name']} preset)", ""]
    if not results.get("complete"):
        lines += ["**Partial results: the study has not finished.**", ""]
    lines += [
        "Regenerate (resumes from its checkpoints if interrupted):", "", "```bash", SETUP,
        results["command"], "```", "",
        "Without `--data` the command reads `~/.cache/kvlab/tinyshakespeare.txt`, or downloads Tiny Shakespeare "
        "from char-rnn's GitHub and checks its sha256, so online it trains on the same bytes.", "",
        f"Wall time: **{minutes(prov['wall_seconds_all_invocations'])}** on {prov['machine']['cpu']} "
        f"({code_and_machine(prov)['cores']} cores, torch {code_and_machine(prov)['versions']['torch']}, "
        f"{plural(p['threads'] or prov['machine']['torch_threads'], 'thread')}){stages(prov)}.", "",
    ]
    lines += setup_section(results) + findings_section(results) + quality_section(results, figures)
    lines += memory_section(results, figures) + speed_section(results, figures) + uptrain_section(results, figures)
    lines += samples_section(results)
    if discussion:
        lines += ["## Discussion", "", discussion.strip(), ""]
    lines += caveats_section(results) + provenance_section(results)
    return "\n".join(lines).rstrip() + "\n"


def setup_section(results: dict) -> list[str]:
    p = results["preset"]
    cells = []
    for v in results["variants"]:
        c = v["config"]
        cached = (f"latent {c['kv_lora_rank']} + RoPE key {c['qk_rope_head_dim']}" if v["kv_heads"] is None
                  else f"K and V: 2 x {v['kv_heads']} x {c['dim'] // c['n_heads']}")
        cells.append([v["variant"], v["attention"], v["kv_heads"] or "latent", f"{v['params']:,}", cached,
                      f"{v['kv_bytes_per_token']:,}"])
    rows = table(["variant", "attention", "KV heads", "parameters", "cached per token per layer",
                  "KV bytes per token"], cells, "llrrlr")
    mla = next((v["config"] for v in results["variants"] if v["kv_heads"] is None), None)
    data = results["provenance"]["data"]
    scope = ("the whole validation split" if p["val_tokens"] is None
             else f"the first {p['val_tokens']:,} validation characters")
    out = [
        "## Set-up", "",
        f"- Data: {data['source']} (sha256 `{data['sha256'][:16]}...`), characters as tokens "
        f"(vocabulary {data['vocab_size']}), first 90% train ({data['train_tokens']:,}), last 10% validation "
        f"({data['val_tokens']:,}).",
        f"- Model: {p['n_layers']} layers, {p['n_heads']} query heads, width {p['dim']}, head dim "
        f"{p['dim'] // p['n_heads']}, context {p['block_size']}; pre-LayerNorm, GELU MLP (4x), tied embeddings, "
        "no biases, RoPE (so decoding runs past the training context).",
        f"- Training: {p['steps']} steps of {p['batch_size']} x {p['block_size']} characters, AdamW "
        f"(lr {p['lr']:g} -> {p['min_lr']:g}, {p['warmup']} warm-up steps then cosine, betas 0.9/0.99, "
        "weight decay 0.1 on matrices), gradient clipping at 1.0, fp32. Seeds "
        f"{', '.join(map(str, results['seeds']))}: each seed fixes the initial weights and the batch order, "
        "identical across variants.",
        f"- Validation loss: mean cross-entropy (nats per character) over {scope} in non-overlapping "
        f"{p['block_size']}-character windows.",
    ]
    if mla:
        out.append(f"- MLA: latent rank {mla['kv_lora_rank']}, decoupled RoPE key {mla['qk_rope_head_dim']}, "
                   f"query/key no-RoPE part {mla['qk_nope_head_dim']}, value heads {mla['v_head_dim']}: "
                   f"{ratio(results, 'mla', 'mha')} MHA's parameters; decoding uses the absorbed path over the "
                   "cached latent.")
    out += ["", *rows, ""]
    return out


def findings_section(results: dict) -> list[str]:
    from kvlab.report.gqa_findings import findings

    items = findings(results)
    if not items:
        return []
    return ["## Findings (computed from results.json)", "", *items, ""]


def figure(figures: dict, name: str, alt: str) -> list[str]:
    return [f"![{alt}]({figures[name]})", ""] if name in figures else []


def quality_section(results: dict, figures: dict) -> list[str]:
    summary, runs = results["summary"], results["runs"]
    if not summary:
        return []
    seeds = results["seeds"]
    head = ["variant", "KV heads", *(f"seed {s}" for s in seeds), "mean", "std", "range", "train tokens/s"]
    cells = []
    for name, item in summary.items():
        by_seed = {r["seed"]: r["val_loss"] for r in runs if r["variant"] == name}
        cells.append([name, item["kv_heads"] or "latent", *(f"{by_seed[s]:.4f}" if s in by_seed else "-" for s in seeds),
                      f"**{item['val_loss_mean']:.4f}**", f"{item['val_loss_std']:.4f}",
                      f"{item['val_loss_max'] - item['val_loss_min']:.4f}", f"{item['train_tokens_per_s_mean']:,.0f}"])
    rows = table(head, cells, "l" + "r" * (len(head) - 1))
    return (["## Quality: validation loss", "", *rows, ""] + figure(figures, "val_loss", "validation loss")
            + figure(figures, "training", "training curves"))


def memory_section(results: dict, figures: dict) -> list[str]:
    decode = results.get("decode") or {}
    if not decode:
        return []
    batches = sorted({b for cells in decode.values() for b in cells}, key=int)
    head = ["variant", "bytes per token", *(f"batch {b}: {what}" for b in batches for what in ("plan", "cache.nbytes()"))]
    per_token = {v["variant"]: v["kv_bytes_per_token"] for v in results["variants"]}
    lines = []
    for name, cells in decode.items():
        parts = []
        for b in batches:
            cell = cells.get(b)
            parts += [exact_and_binary(cell["kv_bytes_formula"]), exact_and_binary(cell["kv_bytes_measured"])] \
                if cell else ["-", "-"]
        lines.append([name, f"{per_token.get(name, 0):,}", *parts])
    rows = table(head, lines, "l" + "r" * (len(head) - 1))
    context = next(iter(next(iter(decode.values())).values()))["context"]
    return (["## Memory: KV-cache bytes", "",
             f"At the decode context of {context:,} tokens (the cache is allocated for the prompt plus every "
             "new token; fp32, the model's dtype):", "", *rows, ""] + figure(figures, "cache_bytes", "cache bytes"))


def speed_section(results: dict, figures: dict) -> list[str]:
    decode = results.get("decode") or {}
    if not decode:
        return []
    batches = sorted({b for cells in decode.values() for b in cells}, key=int)
    head = ["variant", *(what for b in batches for what in (f"batch {b} tok/s (median)", "runs"))]
    lines = []
    for name, cells in decode.items():
        parts = []
        for b in batches:
            cell = cells.get(b)
            parts += [f"{cell['tokens_per_s_median']:,.0f}",
                      ", ".join(f"{x:,.0f}" for x in cell["tokens_per_s_runs"])] if cell else ["-", "-"]
        lines.append([name, *parts])
    rows = table(head, lines, "l" + "rl" * len(batches))
    tokens = next(iter(next(iter(decode.values())).values()))["tokens"]
    return (["## Speed: decode tokens/s", "",
             f"Greedy generation of {tokens:,} tokens from a one-character prompt (prefill included), all "
             "variants in one process, interleaved within each repeat with the order rotated; tokens/s counts every "
             "sequence of the batch. MLA decodes with its absorbed path.", "", *rows, ""]
            + figure(figures, "decode_speed", "decode speed"))


def uptrain_section(results: dict, figures: dict) -> list[str]:
    records = results.get("uptraining") or []
    if not records:
        return []
    scratch = {item["kv_heads"]: item["val_loss_mean"] for item in results["summary"].values()}
    lines = []
    for r in sorted(records, key=lambda r: (-r["kv_heads"], r["val_loss_after"])):
        ref = scratch.get(r["kv_heads"])
        lines.append([r["method"], r["kv_heads"], f"{r['val_loss_before']:.4f}", f"**{r['val_loss_after']:.4f}**",
                      f"{r['val_loss_after'] - r['val_loss_before']:+.4f}", r["steps"],
                      "-" if ref is None else f"{ref:.4f}"])
    control = results.get("uptrain_control")
    if control:
        lines.append(["none (MHA control)", control["kv_heads"], f"{control['val_loss_before']:.4f}",
                      f"{control['val_loss_after']:.4f}", f"{control['val_loss_after'] - control['val_loss_before']:+.4f}",
                      control["steps"], "-"])
    rows = table(["method", "KV heads", "val loss before", "after", "change", "steps", "from scratch (seed mean)"],
                 lines, "lrrrrrr")
    p = results["preset"]
    return (["## Uptraining: MHA converted to fewer KV heads", "",
             f"The seed-{results['seeds'][0]} MHA model's key and value projections are pooled within each group "
             "of query heads (kvlab.checkpoints.convert): by their mean, by keeping the group's first head, or "
             f"replaced by random weights; then all weights are fine-tuned for {p['uptrain_fraction']:.0%} of the "
             f"original steps (AdamW from fresh moments, lr {p['uptrain_lr']:g} -> {p['min_lr']:g}, cosine after a "
             "10% warm-up, batches the pre-training never drew in that order). Before/after are full validation "
             "losses; the curves use the periodic evaluation batches.", "", *rows, ""]
            + figure(figures, "uptraining", "uptraining curves"))


def samples_section(results: dict) -> list[str]:
    seed = results["seeds"][0]
    out = [f"## Samples (seed {seed}, temperature 0.8, prompt: a newline)", ""]
    for run in results["runs"]:
        if run["seed"] == seed:
            out += [f"**{run['variant']}**", "", "```text", run["sample"].rstrip(), "```", ""]
    return out if len(out) > 2 else []


def caveats_section(results: dict) -> list[str]:
    return ["## What this does and does not show", "",
            f"- Small models, short training ({results['preset']['steps']} steps; see the training curves for "
            "whether the models were still improving): quality gaps at this scale need not carry over to large "
            "models or longer training.",
            "- Two seeds give a range, not a confidence interval; \"within seed noise\" means the difference is "
            "no larger than the seed-to-seed range.",
            "- Speed is CPU decode on a shared 2-core machine; the runs were interleaved and the median kept, but "
            "other jobs can still shift numbers by tens of percent (see the load averages under Provenance).",
            "- Decode speed was measured once per variant on the first seed's weights; weights do not change "
            "the arithmetic, so those figures live once in the results' decode section, not copied into each "
            "seed's record.",
            "- Uptraining ran once per method and head count, from one MHA model (the first seed): the method "
            "differences have no spread of their own, and the from-scratch seed range is only a proxy for it.", ""]


def provenance_section(results: dict) -> list[str]:
    prov = results["provenance"]
    code = code_and_machine(prov)
    commit = code["commit"] or "unknown"
    changed = code["changed"]
    dirty = (f" plus uncommitted changes to {', '.join(changed)}" if changed else
             " (with uncommitted changes under src/)" if code["dirty_src"] else "")
    versions = ", ".join(f"{k} {v}" for k, v in code["versions"].items() if v)
    lines = ["## Provenance", "",
             f"- Code: commit `{commit}`{dirty}; {versions}.",
             f"- Machine: {prov['machine']['platform']}, {prov['machine']['cpu']}, {code['cores']} "
             "cores. Load average (1, 5, 15 min) is shown per invocation: the study itself adds about 1 (one "
             "thread); more means other jobs shared the machine."]
    for run in prov.get("earlier_invocations", []):
        ran = (run.get("git_commit") or (run.get("git") or {}).get("commit") or "unknown").removesuffix("+dirty")
        lines.append(f"- Invocation started {run['started']}: {minutes(run['seconds'])}, code `{ran[:12]}`, load "
                     f"{run['load_average_start']} at start, {run['load_average_end']} at the end.")
    lines += [f"- Invocation started {prov['started']} (wrote this report): {minutes(prov['wall_seconds'])}, load "
              f"{prov['load_average_start']} at start, {code['load_now']} at the end.",
              "- Everything above is in `results.json` next to this file (runs, histories, every timing repeat).", ""]
    return lines
