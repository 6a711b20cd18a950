"""Speculative decoding on SmolLM2-135M: acceptance and speed, with and without speculation, in one run.

    flock /tmp/kvlab-heavy.lock kvlab bench speculative --out reports/speculative

Grid: batch 1 and 8, temperature 0 and 0.7, two workloads (chat: held-out ShareGPT first
turns; predictable: held-out code and list requests, kvlab.draft.prompts), methods: the two
trained drafts (`kvlab draft train`, sizes xs and s), the self-draft (the target's first
layers) and n-gram lookup (matches of 1 to 4 tokens, and of 2 to 4: "ngram-2"), k in {2, 4}
everywhere plus the full k = 1..6 sweep for the trained drafts at batch 1, greedy, in both
workloads. Each cell (batch, temperature, workload) runs its plain-decoding baseline before
and after its speculative runs, so every ratio is against plain decoding measured minutes
apart in the same process; greedy runs also check that the tokens equal the baseline's.
Every engine shares one loaded target. Speeds are decode speeds: generated tokens after the first over the time from each group's
first token to its last (the prompts' prefill excluded, a draft model's catch-up over the
prompt included); results.json also keeps end-to-end tok/s.
Before the grid and again after it, kvlab.bench.spec_costs times what a proposer round and a
verification of k + 1 tokens cost against a plain step (the report uses their mean and shows
both), so the report can hold the measured speed-ups against the paper's formula with this
machine's costs, and say what acceptance a target would need.
The JSON keeps every run; the README is written from it (kvlab.bench.speculative_report).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

DRAFTS = ("xs", "s")
BATCHES = (1, 8)
TEMPERATURES = (0.0, 0.7)
K_SMALL = (2, 4)
K_SWEEP = (1, 2, 3, 4, 5, 6)


def default_draft_dir(size: str) -> str:
    from kvlab.train.data import cache_dir
    return str(cache_dir() / "drafts" / f"smollm2-draft-{size}")


def workload_prompts(tokenizer, workload: str, n: int) -> list[list[int]]:
    from kvlab.draft.corpus import chat_ids
    from kvlab.draft.prompts import questions, split
    held_out = split(questions(workload)[0], held_out=True)
    return [chat_ids(tokenizer, q)[-256:] for q in held_out[:n]]


def methods(drafts: dict[str, str], self_layers: int) -> list[tuple[str, dict]]:
    out = [(f"draft-{size}", {"method": "draft_model", "model": path}) for size, path in drafts.items()]
    out.append((f"self-{self_layers}", {"method": "self", "num_layers": self_layers}))
    out.append(("ngram", {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}))
    # a match of two tokens or more: fewer proposals, each likelier to hold, where every drafted row costs
    out.append(("ngram-2", {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
    return out


def run_once(model, tokenizer, prompts, temperature: float, max_tokens: int, spec: Optional[dict],
             batch: int, seed: int = 0) -> dict:
    """`prompts` through a fresh engine, `batch` at a time; tokens, seconds and the speculation counters."""
    from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=64 << 20, max_num_seqs=batch,
                                                      speculative_config=spec, seed=seed))
    engine.add_request(prompts[0][:8], SamplingParams(temperature=0, max_tokens=4))  # warm-up: pages, packing
    engine.run_until_done()
    engine.runner.spec_stats.__init__()
    outputs, seconds, decode_seconds, decode_tokens = [], 0.0, 0.0, 0
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        seqs = [engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                                     seed=seed + start + i)) for i, p in enumerate(group)]
        began = time.perf_counter()
        engine.run_until_done()
        seconds += time.perf_counter() - began
        # decode: from the group's first token (the prompts' prefill is done) to its last
        decode_seconds += max(s.last_token_time for s in seqs) - min(s.first_token_time for s in seqs)
        decode_tokens += sum(len(s.output_ids) - 1 for s in seqs)
        outputs += [list(s.output_ids) for s in seqs]
    stats = engine.spec_stats
    tokens = sum(len(o) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "end_to_end_tok_s": tokens / seconds,
            "decode_tokens": decode_tokens, "decode_seconds": decode_seconds, "tok_s": decode_tokens / decode_seconds,
            "outputs": outputs,
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens, "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "accepted_per_position": list(stats.accepted_per_position)}


def run(args: argparse.Namespace, on_cell=None) -> dict:
    from kvlab.bench.provenance import provenance
    from kvlab.bench.spec_costs import combine_costs, measure_step_costs
    from kvlab.checkpoints.resolve import load_model
    from kvlab.train.progress import progress_bar

    torch.manual_seed(0)
    loaded = load_model(args.model, torch.float32, "gguf")
    model, tokenizer = loaded.model, loaded.tokenizer
    drafts = {size: path for size, path in ((s, getattr(args, f"draft_{s}")) for s in DRAFTS) if os.path.isdir(path)}
    missing = [s for s in DRAFTS if s not in drafts]
    if missing:
        print(f"[kvlab bench] note: no trained draft {', '.join(missing)} (run `kvlab draft train`); skipped",
              file=sys.stderr)
    grid = []
    batches, temperatures, k_small, k_sweep = BATCHES, TEMPERATURES, K_SMALL, K_SWEEP
    if args.quick:  # one locked slice of under five minutes: k = 3 everywhere, k in {1, 2, 4, 6} for the drafts
        k_small, k_sweep = (3,), (1, 2, 4, 6)
    if args.smoke:
        k_small, k_sweep = (2,), (1, 2)
    for workload in ("chat", "predictable"):
        for batch in batches:
            for temperature in temperatures:
                runs = []
                for name, spec in methods(drafts, args.self_layers):
                    sweep = k_sweep if (batch == 1 and temperature == 0 and name.startswith("draft")) else k_small
                    runs += [(name, k, {**spec, "num_speculative_tokens": k}) for k in sweep]
                grid.append((workload, batch, temperature, runs))
    total = sum(len(runs) + 2 for *_, runs in grid)
    bar = progress_bar(total, "speculative", unit="run", enabled=sys.stderr.isatty())
    cells = []
    header = {"benchmark": "speculative", "command": "kvlab " + " ".join(args.argv), "model": args.model, "max_tokens": args.max_tokens,
              "prompts_batch1": args.prompts_b1, "self_layers": args.self_layers, "drafts": draft_summaries(drafts),
              "provenance": provenance()}
    prompts = {w: workload_prompts(tokenizer, w, max(*BATCHES, args.prompts_b1)) for w in ("chat", "predictable")}
    # what a proposer round and a verification cost here, at the chat requests' mean context mid-answer
    context = round(sum(map(len, prompts["chat"][:args.prompts_b1])) / args.prompts_b1) + args.max_tokens // 2
    proposers = {name: spec for name, spec in methods(drafts, args.self_layers) if spec["method"] != "ngram"}
    costs_before = measure_step_costs(model, tokenizer, proposers, context)
    header["step_costs"] = costs_before
    for workload, batch, temperature, runs in grid:
        chosen = prompts[workload][:args.prompts_b1] if batch == 1 else prompts[workload][:batch]
        base = [run_once(model, tokenizer, chosen, temperature, args.max_tokens, None, batch)]
        bar and bar.update(1)
        results = []
        for name, k, spec in runs:
            result = run_once(model, tokenizer, chosen, temperature, args.max_tokens, spec, batch)
            result.update({"method": name, "k": k})
            if temperature == 0:
                result["greedy_identical"] = result["outputs"] == base[0]["outputs"]
            results.append(result)
            bar and bar.update(1)
        base.append(run_once(model, tokenizer, chosen, temperature, args.max_tokens, None, batch))
        bar and bar.update(1)
        base_tok_s = sum(b["decode_tokens"] for b in base) / sum(b["decode_seconds"] for b in base)
        for result in results:
            result["speedup"] = result["tok_s"] / base_tok_s
            del result["outputs"]
        cells.append({"workload": workload, "batch": batch, "temperature": temperature,
                      "requests": len(chosen), "baseline_tok_s": base_tok_s,
                      "baseline_runs_tok_s": [b["tok_s"] for b in base], "runs": results})
        if on_cell is not None:  # what is done so far, so a run cut short still leaves its figures
            on_cell({**header, "cells": cells, "partial": True})
        print(f"[kvlab bench] {workload} b{batch} t{temperature}: base {base_tok_s:.1f} tok/s; best "
              + max((f"{r['speedup']:.2f}x {r['method']} k={r['k']}" for r in results), default="-"),
              file=sys.stderr, flush=True)
    bar and bar.close()
    header["step_costs"] = combine_costs([costs_before, measure_step_costs(model, tokenizer, proposers, context)])
    return {**header, "cells": cells, "partial": False}


def draft_summaries(drafts: dict[str, str]) -> dict:
    """What `kvlab draft train` recorded about each draft (kvlab_draft.json): steps, tokens, validation."""
    import json
    out = {}
    for size, path in drafts.items():
        summary = Path(path) / "kvlab_draft.json"
        if summary.is_file():
            info = json.loads(summary.read_text())
            out[size] = {k: info.get(k) for k in ("command", "size", "objective", "status", "step", "steps", "tokens",
                                                   "train_seconds", "model_config", "validation", "params",
                                                   "train_answers", "val_answers", "history")}
    return out


def run_command(args: argparse.Namespace, on_cell=None) -> dict:
    """`kvlab bench speculative`: the drafts' defaults filled in, then `run` (on_cell: each partial result)."""
    args.draft_xs = args.draft_xs or default_draft_dir("xs")
    args.draft_s = args.draft_s or default_draft_dir("s")
    return run(args, on_cell=on_cell)
