"""What a speculative step costs on this machine, in plain decode steps: the measured side of the paper's formula.

Leviathan et al.'s expected speed-up, (1 - a^(k+1)) / ((1 - a)(k c + v)), takes two costs
relative to a plain batch-1 decode step: c, one proposer round for one drafted token, and v,
the target's verification of k + 1 tokens. Where decode is bound by reading the weights, v is
1; on a CPU each extra row is real arithmetic, so v is measured here rather than assumed:
- verify_cost[n]: the target's C step feeding n tokens of one sequence (its last token and
  n - 1 drafts, logits for every row, as the engine's verification asks) over the same step
  feeding one token, at the same context;
- draft_cost[method]: one proposer round (a draft model's C step over its own side of the
  pool, or the target's C step cut to its first layers) over the target's one-token step.
Every shape is timed in turn within each repetition (so a slow spell on a shared machine lands
on all of them) and each figure is the median over repetitions; the KV the steps read is real
(a prompt of `context` tokens written first) and the same blocks are overwritten every call.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

MAX_ROWS = 7  # verifications of up to k = 6 drafts, as the benchmark's sweep


def timed(call, iterations: int) -> float:
    """Seconds per call of `call`, over `iterations` calls in a row."""
    began = time.perf_counter()
    for _ in range(iterations):
        call()
    return (time.perf_counter() - began) / iterations


def interleaved_medians(calls: dict, repetitions: int, iterations: int) -> dict[str, float]:
    """Milliseconds per call of each named callable: one warm-up call each (pages, arenas' growth, the
    library's kernel choice), then `repetitions` rounds timing each in turn, so a change of load on a shared
    machine falls on all of them alike; the median of the rounds."""
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(repetitions):
        for key, call in calls.items():
            samples[key].append(timed(call, iterations))
    return {key: 1e3 * statistics.median(values) for key, values in samples.items()}


def _engine(model, tokenizer, spec: Optional[dict]):
    from kvlab.engine import EngineConfig, LLMEngine
    return LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=64 << 20, max_num_seqs=1, speculative_config=spec))


@torch.inference_mode()
def measure_step_costs(model, tokenizer, proposers: dict[str, dict], context: int = 256, max_rows: int = MAX_ROWS,
                       repetitions: int = 7, iterations: int = 8, verifier: str = "fused") -> dict:
    """Milliseconds per step and the ratios above; `proposers` maps a method's name to its speculative_config
    (draft_model or self; n-gram lookup drafts without a model and costs no step). Empty where the target
    has no C paged step (the ratios would describe the module-by-module path, which the engine avoids).
    `verifier` "hybrid" times the target's steps (every row count, the one-token step too) on the hybrid
    step (kvlab.nn.hybrid_step: library products, C attention), which the engine takes past the crossover."""
    target = _engine(model, tokenizer, None)
    step = target.runner.paged_step if verifier == "fused" else target.runner.hybrid_step
    if step is None:
        return {}
    block_size = target.pool.block_size
    table = list(range(-(-(context + max_rows) // block_size)))
    drawn = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    prompt = [int(t) for t in drawn]
    step.feeds([prompt], [0], [table], logit_rows=[context - 1])
    calls = {f"verify:{n}": (lambda n=n: step.feeds([prompt[:n]], [context], [table], logit_rows=list(range(n))))
             for n in range(1, max_rows + 1)}
    keep = [target]  # the engines own the pools the steps write into: alive until the timing is done
    for name, spec in proposers.items():
        engine = _engine(model, tokenizer, spec)
        draft_step = engine.runner.draft_step
        if draft_step is None:
            continue
        keep.append(engine)
        draft_step.feeds([prompt], [0], [table], logit_rows=[context - 1])  # its own K/V (a draft model's pool)
        calls[f"draft:{name}"] = lambda s=draft_step: s.feeds([prompt[:1]], [context], [table])
    ms = interleaved_medians(calls, repetitions, iterations)
    plain = ms["verify:1"]
    return {"context": context, "repetitions": repetitions, "iterations": iterations, "verifier": verifier,
            "plain_step_ms": plain,
            "step_ms": ms,
            "verify_cost": {str(n): ms[f"verify:{n}"] / plain for n in range(1, max_rows + 1)},  # JSON's keys
            "draft_cost": {key.split(":", 1)[1]: value / plain for key, value in ms.items() if key.startswith("draft:")}}


def combine_costs(runs: list[dict]) -> dict:
    """Several measurements (before and after a benchmark's grid) as one: each ratio's mean, and every run kept
    under "runs" so the report can show the spread."""
    runs = [run for run in runs if run]
    if not runs:
        return {}
    first = runs[0]

    def mean(pick):
        return sum(pick(run) for run in runs) / len(runs)

    return {"context": first["context"], "repetitions": first["repetitions"], "iterations": first["iterations"],
            "plain_step_ms": mean(lambda run: run["plain_step_ms"]),
            "verify_cost": {n: mean(lambda run: run["verify_cost"][n]) for n in first["verify_cost"]},
            "draft_cost": {name: mean(lambda run: run["draft_cost"][name]) for name in first["draft_cost"]},
            "runs": runs}
