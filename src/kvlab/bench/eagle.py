"""An EAGLE head on SmolLM2-135M: acceptance per draft position and the batch-1 greedy chat speed-up.

    flock /tmp/kvlab-heavy.lock kvlab bench eagle --out reports/speculative/eagle

Held-out ShareGPT first turns (never in the head's training split), greedy, batch 1, EOS
ignored. Runs are interleaved in one process: plain decoding, then the head at each k, and
again for every round, with a last plain run; each speed-up is against the mean of all plain
runs. Greedy runs check their tokens equal plain decoding's. Costs (kvlab.bench.spec_costs's
verification of n tokens, plus one head round here: the head over its window and one
embedding row) are measured in the same process, in plain steps, so the speed-up can be
read against L / (k c + v). Writes results.json and README.md into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from kvlab.errors import KvlabError


def default_head_dir() -> str:
    from kvlab.train.data import cache_dir
    return str(cache_dir() / "drafts" / "smollm2-eagle")


@torch.inference_mode()
def head_round_ms(model, tokenizer, head_path: str, repetitions: int = 7, iterations: int = 20) -> float:
    """Milliseconds for one draft round: the head over a full window and one token's embedding."""
    from kvlab.bench.spec_costs import timed
    from kvlab.engine import EngineConfig, LLMEngine
    from kvlab.nn.c_model import embed_rows
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=16 << 20, max_num_seqs=1,
                                                      speculative_config={"method": "eagle", "model": head_path}))
    eagle = engine.runner.eagle
    w, dim = eagle.window, model.config.dim
    emb, hid = torch.randn(1, w, dim), torch.randn(1, w, dim)

    def one():
        eagle.head(emb, hid)
        embed_rows(model, torch.tensor([7]))
    one()
    return 1e3 * statistics.median(timed(one, iterations) for _ in range(repetitions))


def run(args: argparse.Namespace) -> dict:
    from kvlab.bench.provenance import provenance
    from kvlab.bench.spec_costs import measure_step_costs
    from kvlab.bench.speculative import run_once, workload_prompts
    from kvlab.checkpoints.resolve import load_model
    from kvlab.train.progress import progress_bar

    torch.manual_seed(0)
    loaded = load_model(args.model, torch.float32, "gguf")
    model, tokenizer = loaded.model, loaded.tokenizer
    prompts = workload_prompts(tokenizer, "chat", args.prompts)
    head_meta = json.loads((Path(args.head) / "config.json").read_text())
    context = round(sum(map(len, prompts)) / len(prompts)) + args.max_tokens // 2
    costs = measure_step_costs(model, tokenizer, {}, context)
    head_ms = head_round_ms(model, tokenizer, args.head)
    plain_runs, runs = [], {k: [] for k in args.k}
    bar = progress_bar(args.rounds * (1 + len(args.k)) + 1, "eagle", unit="run", enabled=sys.stderr.isatty())
    for _ in range(args.rounds):
        plain_runs.append(run_once(model, tokenizer, prompts, 0.0, args.max_tokens, None, 1))
        bar and bar.update(1)
        for k in args.k:
            spec = {"method": "eagle", "model": args.head, "num_speculative_tokens": k}
            runs[k].append(run_once(model, tokenizer, prompts, 0.0, args.max_tokens, spec, 1))
            bar and bar.update(1)
    plain_runs.append(run_once(model, tokenizer, prompts, 0.0, args.max_tokens, None, 1))
    bar and bar.update(1)
    bar and bar.close()
    base = sum(r["decode_tokens"] for r in plain_runs) / sum(r["decode_seconds"] for r in plain_runs)
    plain_step = costs.get("plain_step_ms")
    head_cost = head_ms / plain_step if plain_step else None
    results = []
    for k, rs in runs.items():
        tok_s = sum(r["decode_tokens"] for r in rs) / sum(r["decode_seconds"] for r in rs)
        drafts = sum(r["num_drafts"] for r in rs)
        accepted = [sum(r["accepted_per_position"][i] if i < len(r["accepted_per_position"]) else 0 for r in rs)
                    for i in range(k)]
        length = 1 + sum(accepted) / drafts if drafts else 1.0
        verify = costs.get("verify_cost", {}).get(str(k + 1))
        step_cost = verify + k * head_cost if verify and head_cost is not None else None
        results.append({"k": k, "tok_s": tok_s, "speedup": tok_s / base, "num_drafts": drafts,
                        "acceptance_rate": sum(accepted) / max(1, sum(r["num_draft_tokens"] for r in rs)),
                        "acceptance_per_position": [a / drafts if drafts else 0.0 for a in accepted],
                        "mean_acceptance_length": length, "step_cost": step_cost,
                        "predicted_speedup": length / step_cost if step_cost else None,
                        "length_needed_for_1_5x": 1.5 * step_cost if step_cost else None,
                        "greedy_identical": all(r["outputs"] == plain_runs[0]["outputs"] for r in rs),
                        "runs_tok_s": [r["tok_s"] for r in rs]})
    return {"benchmark": "eagle", "command": "kvlab " + " ".join(args.argv),
            "model": args.model, "head": args.head,
            "head_config": {k: v for k, v in head_meta.items() if k != "kvlab_train"},
            "head_training": {k: head_meta.get("kvlab_train", {}).get(k) for k in
                              ("command", "status", "step", "positions", "train_seconds", "draft_vocab_coverage",
                               "validation", "params", "train_sequences")},
            "prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds,
            "baseline_tok_s": base, "baseline_runs_tok_s": [r["tok_s"] for r in plain_runs],
            "step_costs": costs, "head_round_ms": head_ms, "head_round_cost": head_cost,
            "results": results, "provenance": provenance()}


def run_command(args: argparse.Namespace) -> dict:
    """`kvlab bench eagle`: the head checked, then `run`."""
    args.head = args.head or default_head_dir()
    if not (Path(args.head) / "config.json").is_file():
        raise KvlabError(f"no EAGLE head in {args.head} (train one: kvlab draft train --method eagle)")
    return run(args)
