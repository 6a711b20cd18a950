"""reports/real-models, measured: SmolLM2-135M's and Gemma 3 270M's quality under every KV setting beside its serving consequence.

`kvlab bench real-models` measures whatever results.json does not hold yet (resumable, stopping
after the cell that passes --max-seconds so each run stays short), then tabulates every row into
serving.json (`tabulate`), from which kvlab.report.real_models renders README.md:

    flock /tmp/kvlab-heavy.lock kvlab bench real-models --max-seconds 540

Repeat it until it says the report is complete. Quality comes from kvlab.evals (perplexity
through the cache, passkey retrieval); seats per card from kvlab.plan at 8k context; the
engine's capacity line from constructing kvlab's engine for the settings its paged pool serves.
SmolLM2 is measured first (its rows, the engine's throughput, the uptrained row), then Gemma 3
(kvlab.bench.real_models_gemma: its rows, then the engine's throughput, or its refusal, per row).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from kvlab.bench import real_models_gemma as gemma
from kvlab.bench import real_models_throughput as throughput
from kvlab.bench import real_models_uptrain as uptrain
from kvlab.bench.real_models_study import (CHUNK, CONTEXT, DEPTHS, EVAL_TEXT, OFFSET, SEEDS, SERVE_CONTEXT, TRIALS,
                                           WINDOWS, Study, serving, summarise)
from kvlab.evals.setting import KVSetting
from kvlab.files import write_json

MODEL = "smollm2-135m"
OUT = Path(__file__).resolve().parents[3] / "reports" / "real-models"
CALIBRATION_TEXT = "pride-and-prejudice.txt"  # calibrate on one novel, evaluate on another
WINDOW, SINKS = 256, 4
ENGINE_MEMORY = 256 * 2**20  # the engine's pool for its capacity line (host memory here)
ENGINE_SEATS = throughput.REQUESTS  # its --max-num-seqs: KIVI and KVQuant keep state per seat

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


def step_keys(only: Optional[str]):
    """Whether a step runs: every step, or with --only those whose key starts with one of its comma-separated
    prefixes. Keys: `smollm2:LABEL` (a SmolLM2 row's quality cells), `throughput:LABEL` (its engine run),
    `uptrain` (the uptraining run and its row), `gemma:LABEL` (a Gemma 3 row's quality cells),
    `gemma-throughput:LABEL` (its engine run)."""
    prefixes = tuple(p for p in (only or "").split(",") if p)
    return lambda key: not prefixes or key.startswith(prefixes)


def measure(out: Path, max_seconds: float, threads: int, only: Optional[str] = None) -> bool:
    """Fill both studies' results files (only the steps `only` names, when given); True when every cell is there."""
    import torch

    from kvlab.checkpoints.resolve import load_model
    from kvlab.evals.runner import Evaluator

    torch.set_num_threads(threads)
    started = time.monotonic()
    wanted = step_keys(only)
    jobs = evaluate(out, SMOLLM2, started, max_seconds, threads, wanted)
    engine_runs(out, SMOLLM2, "throughput", jobs, started, max_seconds, threads, wanted)
    # the uptrained row last (the longest): its training run in slices, then its cells on its own weights
    while wanted("uptrain") and not uptrain.finished() and time.monotonic() - started <= max_seconds:
        print("real_models: uptraining the 1-KV-head conversion (a slice)", file=sys.stderr)
        uptrain.run_slice(MODEL, shared_file("data", "english", uptrain.TRAIN_TEXT))
    if wanted("uptrain") and uptrain.finished():
        write_json(out / "uptrain.json", uptrain.last_report(), indent=1)  # the run, kept
        store = jobs[0][0].store
        trained = Evaluator(load_model(str(uptrain.model_dir()), torch.float32, "dense"), store)
        jobs += [(trained, uptrain.SETTING, task) for task in study_tasks(SMOLLM2)]
        run(jobs, started, max_seconds, threads)
    # then Gemma 3, whose cells are all quality cells
    in_time = time.monotonic() - started <= max_seconds
    gemma_jobs = evaluate(out, gemma.STUDY, started, max_seconds, threads, wanted) if in_time else None
    if gemma_jobs is not None:
        engine_runs(out, gemma.STUDY, "gemma-throughput", gemma_jobs, started, max_seconds, threads, wanted)
    return (uptrain.finished() and not throughput.pending(out, SETTINGS) and gemma_jobs is not None
            and all(e.pending(s, t) == 0 for e, s, t in jobs + gemma_jobs)
            and not throughput.pending(out, gemma.STUDY.settings, gemma.STUDY.engine_runs))


def engine_runs(out: Path, study: Study, key: str, jobs: list, started: float, max_seconds: float, threads: int,
                wanted) -> None:
    """A study's engine throughput column (steps `key:LABEL`), once its quality cells are in, until the time is up;
    a converted setting is built from the model loaded once with dense weights."""
    import torch

    from kvlab.checkpoints.resolve import load_model

    dense = None
    for setting in throughput.pending(out, study.settings, study.engine_runs):
        if time.monotonic() - started > max_seconds or any(e.pending(s, t) for e, s, t in jobs):
            break
        if not wanted(f"{key}:{setting.label}"):
            continue
        print(f"real_models: engine throughput, {study.model} {setting.label}", file=sys.stderr)
        if throughput.converted(setting) and dense is None:
            dense = load_model(study.model, torch.float32, "dense")
        throughput.measure(out, study.model, setting, threads, out / study.calibration, dense, study.engine_runs)


def study_tasks(study: Study) -> list:
    """The perplexity task, then one passkey task per seed at the study's lengths."""
    from kvlab.evals.runner import PasskeyTask, PerplexityTask
    return [PerplexityTask(shared_file("data", "english", EVAL_TEXT), CONTEXT, WINDOWS, CHUNK, OFFSET),
            *[PasskeyTask(study.lengths, DEPTHS, TRIALS, seed, CHUNK) for seed in SEEDS]]


def evaluate(out: Path, study: Study, started: float, max_seconds: float, threads: int,
             wanted=lambda key: True) -> list:
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
    prefix = "gemma" if study is gemma.STUDY else "smollm2"
    in_memory = [s for s in study.settings if s != uptrain.SETTING and wanted(f"{prefix}:{s.label}")]
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


def engine_line(setting: KVSetting, model, calibration: Path) -> Optional[str]:
    """The engine's own 'Maximum concurrency' start-up figure for the setting (KVQuant with the study's
    calibration), or None where the engine refuses it (the throughput cell says why)."""
    from kvlab.engine.engine import EngineConfig, LLMEngine
    from kvlab.errors import KvlabError
    try:
        engine = LLMEngine(model, None, EngineConfig(
            kv_cache_dtype=setting.kv_cache_dtype, kv_cache_memory=ENGINE_MEMORY, max_model_len=SERVE_CONTEXT,
            paged_step=False, kv_window=setting.window, sink_tokens=setting.sinks, pre_rope_keys=setting.pre_rope,
            max_num_seqs=ENGINE_SEATS, kv_calibration=str(calibration) if setting.is_kvquant else None))
    except KvlabError:
        return None
    line = next(line for line in engine.capacity_lines if "Maximum concurrency" in line)
    return line[line.index("Maximum concurrency"):]


def tabulate(out: Path) -> dict:
    """Every row's figures (the measured cells summarised, kvlab.plan's seats, the engine's capacity line)
    into serving.json, which the report renders; returns it."""
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
        row["engine_capacity_line"] = engine_line(setting, model, out / SMOLLM2.calibration)
        row["engine_c16_output_tokens_per_s"] = measured.get(setting.label, {}).get("output_tokens_per_s")
        rows.append(row)
    path = out / gemma.STUDY.results
    gemma_store = json.loads(path.read_text()) if path.exists() else {"cells": {}, "runs": []}
    gemma_loaded = load_model(gemma.STUDY.model, torch.float32, "dense")
    gemma_runs = throughput.load(out, gemma.STUDY.engine_runs)["rows"]
    gemma_rows = [{**summarise(gemma_store, s, gemma.STUDY), "serving": serving(s, gemma.STUDY),
                   "engine_capacity_line": engine_line(s, build_model(gemma_loaded, s), out / gemma.STUDY.calibration),
                   "engine_c16_output_tokens_per_s": gemma_runs.get(s.label, {}).get("output_tokens_per_s")}
                  for s in gemma.STUDY.settings]
    doc = {"model": MODEL, "eval_text": EVAL_TEXT, "calibration_text": CALIBRATION_TEXT, "context": CONTEXT,
           "windows": WINDOWS,
           "chunk": CHUNK, "passkey": {"lengths": LENGTHS, "depths": DEPTHS, "trials_per_cell_per_seed": TRIALS,
                                       "seeds": SEEDS}, "serve_context": SERVE_CONTEXT,
           "engine_pool_bytes": ENGINE_MEMORY, "rows": rows, "runs": store["runs"],
           gemma.STUDY.model: {"passkey_lengths": gemma.STUDY.lengths, "rows": gemma_rows, "runs": gemma_store["runs"]}}
    write_json(out / "serving.json", doc, indent=1)
    return doc
