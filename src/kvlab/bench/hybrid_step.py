"""The hybrid decode step (kvlab.nn.hybrid_step: library products, attention in C) against the fused C step.

Two questions, asked of one engine's two steps over one pool, each figure the median over
repetitions with every shape timed in turn within a repetition (a slow spell on a shared machine
lands on all of them):
- a decode step of R rows (R sequences, each one token at `context`): milliseconds fused and
  hybrid, and hybrid / fused. On a CPU with matrix engines the hybrid step is meant to win from
  the crossover on; on an AVX2-only CPU its fp32 library products are expected to lose.
- a verification of n tokens of one sequence (kvlab.bench.spec_costs, `verifier`): milliseconds
  both ways, and each over the fused one-token step (the plain decode step the engine takes at
  batch 1), the cost `v` in the speculative speed-up formula.
Every sequence reads the same `context` tokens of K/V (one prompt written once, its blocks shared)
and writes its own block at `context`; the same slots are overwritten every call.
"""

from __future__ import annotations

import torch

from kvlab.bench.spec_costs import interleaved_medians, measure_step_costs


@torch.inference_mode()
def measure_decode_steps(model, tokenizer, rows: list[int], context: int = 256, repetitions: int = 5,
                         iterations: int = 4) -> dict:
    """Milliseconds per decode step of each row count, fused and hybrid (module doc); {} without both steps."""
    from kvlab.cache.step import StepBatch
    from kvlab.engine import EngineConfig, LLMEngine

    widest = max(rows)
    budget = _pool_bytes(model, context, widest)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=widest, kv_cache_memory=budget, block_size=16))
    fused, hybrid = engine.runner.paged_step, engine.runner.hybrid_step
    if fused is None or hybrid is None:
        return {}
    block = engine.pool.block_size
    if context % block:
        raise ValueError(f"the context must be a multiple of the pool's {block}-token blocks, got {context}")
    shared = context // block  # the prompt's blocks, read by every row
    tables = [list(range(shared)) + [shared + r] for r in range(widest)]  # then one block of its own each
    drawn = torch.randint(0, model.config.vocab_size, (context + widest,), generator=torch.Generator().manual_seed(0))
    fused.feeds([drawn[:context].tolist()], [0], [tables[0][:shared]], logit_rows=[context - 1])
    calls = {}
    for r in rows:
        ids = drawn[context:context + r]
        batch = StepBatch.build([context] * r, [1] * r, tables[:r], block)
        calls[f"fused:{r}"] = lambda ids=ids, batch=batch: fused(ids, batch)
        if r > 1:
            calls[f"hybrid:{r}"] = lambda ids=ids, batch=batch: hybrid(ids, batch)
    hybrid.warm()
    ms = interleaved_medians(calls, repetitions, iterations)
    return {"context": context, "repetitions": repetitions, "iterations": iterations,
            "rows": {str(r): {"fused_ms": ms[f"fused:{r}"], "hybrid_ms": ms.get(f"hybrid:{r}"),
                              "hybrid_over_fused": ms[f"hybrid:{r}"] / ms[f"fused:{r}"] if r > 1 else None}
                     for r in rows}}


def _pool_bytes(model, context: int, rows: int) -> int:
    """A pool budget for the shared prompt and one block per row, with room to spare (fp32 K/V, blocks of 16)."""
    config = model.config
    per_token = config.n_layers * 2 * config.kv_heads * config.head_size * 4
    return per_token * (context + 32 * (rows + 2))


def measure_verification(model, tokenizer, context: int = 256, repetitions: int = 5, iterations: int = 4) -> dict:
    """spec_costs' verification costs on the fused and on the hybrid step, each also over the fused one-token step."""
    both = {verifier: measure_step_costs(model, tokenizer, {}, context, repetitions=repetitions, iterations=iterations,
                                         verifier=verifier) for verifier in ("fused", "hybrid")}
    if not all(both.values()):
        return {}
    plain = both["fused"]["plain_step_ms"]
    for costs in both.values():
        costs["over_fused_plain"] = {key.split(":")[1]: value / plain for key, value in costs["step_ms"].items()}
    return both
