"""An EAGLE head on SmolLM2-135M: acceptance per draft position and the batch-1 greedy chat speed-up.

    flock /tmp/kvlab-heavy.lock kvlab bench eagle --out reports/speculative/eagle
    flock /tmp/kvlab-heavy.lock kvlab bench eagle --method eagle medusa --batch 1 4 \
        --temperature 0 0.7 1.0 --out reports/speculative/heads   # both head kinds, batch 4, sampling

With --method medusa too (a head set from `kvlab draft train --method medusa`, --medusa-head), --batch
and --temperature, every (batch, temperature) cell runs plain decoding and each method at each k in
the same round; a speed-up is against the plain runs of its own cell. A Medusa pass (k heads and their
shared LM head, one row) is timed like an EAGLE round.

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
    """Milliseconds for one draft round as the proposer runs it once its window is kept: one new position's
    inputs (its token's embedding included) and that position over a full window's keys and values."""
    from kvlab.bench.spec_costs import timed
    from kvlab.engine import EngineConfig, LLMEngine
    from kvlab.nn.c_model import embed_rows
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=16 << 20, max_num_seqs=1,
                                                      speculative_config={"method": "eagle", "model": head_path}))
    eagle = engine.runner.head_proposer
    w, dim = eagle.window, model.config.dim
    _, _, keys, values = eagle.head.inputs(torch.randn(1, w, dim), torch.randn(1, w, dim))
    hidden = torch.randn(1, 1, dim)

    def one():
        x, q, _, _ = eagle.head.inputs(embed_rows(model, torch.tensor([7]))[None], hidden)
        eagle.head.last(x, q, keys, values)
    one()
    return 1e3 * statistics.median(timed(one, iterations) for _ in range(repetitions))


@torch.inference_mode()
def medusa_pass_ms(model, tokenizer, head_path: str, k: int, repetitions: int = 7, iterations: int = 20) -> float:
    """Milliseconds for one Medusa pass drafting k tokens for one sequence: k residual heads, one shared LM head."""
    from kvlab.bench.spec_costs import timed
    from kvlab.engine import EngineConfig, LLMEngine
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=16 << 20, max_num_seqs=1,
                                                      speculative_config={"method": "medusa", "model": head_path,
                                                                          "num_speculative_tokens": k}))
    head = engine.runner.head_proposer.head
    hidden = torch.randn(1, model.config.dim)
    head(hidden, k)
    return 1e3 * statistics.median(timed(lambda: head(hidden, k), iterations) for _ in range(repetitions))


def head_costs(model, tokenizer, args) -> dict:
    """Per method, milliseconds per head pass by k (an EAGLE round does not depend on k)."""
    out = {}
    if "eagle" in args.method:
        ms = head_round_ms(model, tokenizer, args.head)
        out["eagle"] = {str(k): ms for k in args.k}
    if "medusa" in args.method:
        out["medusa"] = {str(k): medusa_pass_ms(model, tokenizer, args.medusa_head, k) for k in args.k}
    return out


def head_path(args, method: str) -> str:
    return args.head if method == "eagle" else args.medusa_head


def _tok_s(runs: list[dict]) -> float:
    """Decode tokens per second over `runs` together (not the mean of their rates)."""
    return sum(r["decode_tokens"] for r in runs) / sum(r["decode_seconds"] for r in runs)


def _acceptance(runs: list[dict], k: int) -> dict:
    """What `runs` of one speculative setting at k drafted tokens accepted: per position and on average."""
    drafts = sum(r["num_drafts"] for r in runs)
    accepted = [sum(r["accepted_per_position"][i] if i < len(r["accepted_per_position"]) else 0 for r in runs)
                for i in range(k)]
    return {"num_drafts": drafts,
            "acceptance_rate": sum(accepted) / max(1, sum(r["num_draft_tokens"] for r in runs)),
            "acceptance_per_position": [a / drafts if drafts else 0.0 for a in accepted],
            "mean_acceptance_length": 1 + sum(accepted) / drafts if drafts else 1.0}


def _workload(args: argparse.Namespace):
    """The target, its tokenizer, the held-out chat prompts and the step costs at their mean context."""
    from kvlab.bench.spec_costs import measure_step_costs
    from kvlab.bench.speculative import workload_prompts
    from kvlab.checkpoints.resolve import load_model

    torch.manual_seed(0)
    loaded = load_model(args.model, torch.float32, "gguf")
    model, tokenizer = loaded.model, loaded.tokenizer
    prompts = workload_prompts(tokenizer, "chat", args.prompts)
    context = round(sum(map(len, prompts)) / len(prompts)) + args.max_tokens // 2
    return model, tokenizer, prompts, measure_step_costs(model, tokenizer, {}, context)


def run(args: argparse.Namespace) -> dict:
    if args.method != ["eagle"] or args.batch != [1] or args.temperature != [0.0]:
        return run_grid(args)
    from kvlab.bench.provenance import provenance
    from kvlab.bench.speculative import run_once
    from kvlab.train.progress import progress_bar

    model, tokenizer, prompts, costs = _workload(args)
    head_meta = json.loads((Path(args.head) / "config.json").read_text())
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
    base = _tok_s(plain_runs)
    plain_step = costs.get("plain_step_ms")
    head_cost = head_ms / plain_step if plain_step else None
    results = []
    for k, rs in runs.items():
        tok_s, accepted = _tok_s(rs), _acceptance(rs, k)
        length = accepted["mean_acceptance_length"]
        verify = costs.get("verify_cost", {}).get(str(k + 1))
        step_cost = verify + k * head_cost if verify and head_cost is not None else None
        results.append({"k": k, "tok_s": tok_s, "speedup": tok_s / base, **accepted, "step_cost": step_cost,
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


def run_grid(args: argparse.Namespace) -> dict:
    """Every (batch, temperature) cell: plain decoding and each method at each k, interleaved per round."""
    from kvlab.bench.provenance import provenance
    from kvlab.bench.speculative import run_once
    from kvlab.plan.speculative import acceptance_needed
    from kvlab.train.progress import progress_bar

    model, tokenizer, prompts, costs = _workload(args)
    head_ms = head_costs(model, tokenizer, args)
    cells = [(b, t) for b in args.batch for t in args.temperature]
    plain = {c: [] for c in cells}
    runs = {(m, k, b, t): [] for m in args.method for k in args.k for b, t in cells}
    bar = progress_bar(args.rounds * len(cells) * (1 + len(args.method) * len(args.k)) + len(cells), "heads",
                       unit="run", enabled=sys.stderr.isatty())
    for _ in range(args.rounds):
        for b, t in cells:
            plain[b, t].append(run_once(model, tokenizer, prompts, t, args.max_tokens, None, b))
            bar and bar.update(1)
            for m in args.method:
                for k in args.k:
                    spec = {"method": m, "model": head_path(args, m), "num_speculative_tokens": k}
                    runs[m, k, b, t].append(run_once(model, tokenizer, prompts, t, args.max_tokens, spec, b))
                    bar and bar.update(1)
    for b, t in cells:  # a last plain run per cell: the baseline brackets every speculative run
        plain[b, t].append(run_once(model, tokenizer, prompts, t, args.max_tokens, None, b))
        bar and bar.update(1)
    bar and bar.close()
    rate = {c: _tok_s(rs) for c, rs in plain.items()}
    plain_step = costs.get("plain_step_ms")
    results = []
    for (m, k, b, t), rs in runs.items():
        tok_s, accepted = _tok_s(rs), _acceptance(rs, k)
        length = accepted["mean_acceptance_length"]
        verify = costs.get("verify_cost", {}).get(str(k + 1))
        head_cost = head_ms[m][str(k)] / plain_step if plain_step else None
        passes = k if m == "eagle" else 1
        step_cost = verify + passes * head_cost if verify and head_cost is not None else None
        needed = acceptance_needed(1.5, k, head_cost, verify, passes) if step_cost else None
        results.append({"method": m, "k": k, "batch": b, "temperature": t, "tok_s": tok_s,
                        "speedup": tok_s / rate[b, t], **accepted, "head_pass_ms": head_ms[m][str(k)],
                        "head_pass_cost": head_cost, "head_passes": passes, "step_cost": step_cost,
                        "predicted_speedup": length / step_cost if step_cost else None,
                        "length_needed_for_1_5x": 1.5 * step_cost if step_cost else None,
                        "acceptance_needed_for_1_5x": needed,
                        "greedy_identical": all(r["outputs"] == plain[b, t][0]["outputs"] for r in rs) if t == 0
                        else None,
                        "runs_tok_s": [r["tok_s"] for r in rs]})
    heads = {}
    for m in args.method:
        meta = json.loads((Path(head_path(args, m)) / "config.json").read_text())
        train = meta.get("kvlab_train", {})
        heads[m] = {"path": head_path(args, m), "config": {k: v for k, v in meta.items() if k != "kvlab_train"},
                    "training": {k: train.get(k) for k in ("command", "status", "step", "positions", "train_seconds",
                                                           "draft_vocab_coverage", "validation", "params")}}
    return {"benchmark": "draft heads", "command": "kvlab " + " ".join(args.argv),
            "model": args.model, "heads": heads, "prompts": len(prompts), "max_tokens": args.max_tokens,
            "rounds": args.rounds, "baseline_tok_s": {f"batch {b}, temperature {t:g}": v for (b, t), v in rate.items()},
            "baseline_runs_tok_s": {f"batch {b}, temperature {t:g}": [r["tok_s"] for r in rs]
                                    for (b, t), rs in plain.items()},
            "step_costs": costs, "head_pass_ms": head_ms, "results": results, "provenance": provenance()}


def run_command(args: argparse.Namespace) -> dict:
    """`kvlab bench eagle`: every head asked for checked, then `run`."""
    args.head = args.head or default_head_dir()
    args.medusa_head = args.medusa_head or default_head_dir().replace("smollm2-eagle", "smollm2-medusa")
    for method in args.method:
        if not (Path(head_path(args, method)) / "config.json").is_file():
            raise KvlabError(f"no {method} head in {head_path(args, method)} (train one: kvlab draft train "
                             f"--method {method})")
    return run(args)
