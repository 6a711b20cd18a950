"""How far the serving target can be reached on this machine: the C step's measured costs and the schedules they allow.

    kvlab bench serving-bound [--model smollm2-135m] [--weights gguf-a8] [--json PATH]

The serving report's target, at concurrency 16 (16 prompts of 128 tokens, 24 tokens out each), asks for
output throughput at least 5x the best peer's with p99 TTFT and TPOT no worse than any peer's. A serialised
peer decodes at batch 1, so its TPOT is a one-row step's. What kvlab can do against that is set by two costs
of its C step, measured here on the engine's own pool (interleaved; each the fastest of its repetitions, the
figure most favourable to the target, since this is a ceiling):
- prefill: milliseconds per prompt token, with the workload's prompts going through in one call (the most
  rows per call and the cheapest per token) and one prompt per call;
- decode: milliseconds per step at s rows, one token per sequence, at the context the workload decodes at;
  and the same steps without the LM head (no row asks for scores) and the greedy pick over their scores (an argmax
  per row), so the step splits into layers, LM head and sampling. A large vocabulary moves the split: Gemma 3's
  262,144-row head is most of a 16-row step, SmolLM2's 49,152 rows a fifth.

`schedule_bounds` turns them into the best each number of seats s can do when prompts are prefilled in one
call and sequences decode in groups of s, as `--max-num-seqs s` runs them: every decode step then costs
step(s), which is the TPOT of every request (a step's arithmetic only: HTTP, sampling and detokenising add to
it when served), and the run lasts at least prefill(all prompt tokens) + ceil(requests / s) x
(output_len - 1) x step(s), the first output token coming with the prefill. Mixing prompt rows into decode
steps does not beat this here: a decode row costs more than a prompt row in a large call (it carries the LM
head), and each added row lengthens the step every decoding request waits for.
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

from kvlab.files import write_json
from kvlab.errors import KvlabError

DECODE_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def measure_costs(model, tokenizer, requests: int = 16, input_len: int = 128, output_len: int = 24,
                  kv_cache_dtype: str = "fp16", rows: tuple[int, ...] = DECODE_ROWS, repetitions: int = 5,
                  seed: int = 0) -> dict:
    """The C step's costs for the workload (module doc); empty where the model has no C paged step."""
    import torch

    from kvlab.bench.spec_costs import timed  # imports torch: here, not for the report's pure arithmetic

    with torch.inference_mode():
        engine, calls = workload_steps(model, tokenizer, requests, input_len, output_len, kv_cache_dtype, rows, seed)
        if engine is None:
            return {}
        samples: dict = {key: [] for key in calls}
        for _ in range(repetitions):
            for key, call in calls.items():
                samples[key].append(timed(call, 1 if key[0] == "prefill" else 8))
    ms = {key: 1e3 * min(values) for key, values in samples.items()}
    return {"requests": requests, "input_len": input_len, "output_len": output_len, "kv_cache_dtype": kv_cache_dtype,
            "decode_position": input_len + output_len // 2, "repetitions": repetitions, "seed": seed,
            "prefill_ms_per_token": {str(n): ms[("prefill", n)] / (n * input_len) for n in sorted({1, requests})},
            "decode_step_ms": {str(n): ms[("decode", n)] for n in rows},
            "decode_layers_ms": {str(n): ms[("layers", n)] for n in rows},
            "greedy_pick_ms": {str(n): ms[("pick", n)] for n in rows}}


def workload_steps(model, tokenizer, requests: int, input_len: int, output_len: int, kv_cache_dtype: str,
                   rows: tuple[int, ...], seed: int = 0):
    """(engine, calls): calls[("prefill", n)] runs n of the workload's prompts through the C step in one call,
    calls[("decode", n)] one decode step of n rows at the middle of its decode, calls[("layers", n)] the same step
    with no row's scores asked for (no LM head), calls[("pick", n)] the greedy pick over that step's scores; each
    call run once (its K/V written). Each sequence holds its own blocks in every KV group of the pool (Gemma 3's
    sliding and global layers). The engine owns the pool the calls write into: keep it while they run. (None, {})
    where the model has no C paged step."""
    from kvlab.bench.throughput import random_prompts
    from kvlab.engine import EngineConfig, LLMEngine

    context = input_len + output_len
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=256 << 20, max_num_seqs=max(requests, *rows),
                                                      kv_cache_dtype=kv_cache_dtype))
    step = engine.runner.paged_step
    if step is None:
        return None, {}
    seqs = max(requests, *rows)
    per_seq = -(-context // engine.pool.block_size)
    groups = len(engine.pool.groups)
    if groups * seqs * per_seq > engine.pool.num_blocks:
        raise ValueError(f"{seqs} sequences of {context} tokens in {groups} KV groups need {groups * seqs * per_seq} "
                         f"blocks; the pool has {engine.pool.num_blocks}")
    tables = [[list(range((g * seqs + i) * per_seq, (g * seqs + i + 1) * per_seq)) for i in range(seqs)]
              for g in range(groups)]
    prompts = random_prompts(seqs, input_len, model.config.vocab_size, seed)
    position = input_len + output_len // 2  # the middle of the workload's decode

    def first(n: int) -> list:
        return [group[:n] for group in tables]

    def prefill(n: int):
        return lambda: step.feeds(prompts[:n], [0] * n, first(n),
                                  logit_rows=[input_len * (i + 1) - 1 for i in range(n)])

    def decode(n: int, logit_rows: Optional[list[int]] = None):
        return lambda: step.feeds([[p[0]] for p in prompts[:n]], [position] * n, first(n), logit_rows=logit_rows)

    calls = {("prefill", n): prefill(n) for n in sorted({1, requests})}
    calls.update({("decode", n): decode(n) for n in rows})
    calls.update({("layers", n): decode(n, []) for n in rows})
    for call in calls.values():  # warm-up: the arena's growth, and every row's K/V written before it is read
        call()
    scores = {n: calls[("decode", n)]() for n in rows}
    calls.update({("pick", n): (lambda logits: lambda: logits.argmax(dim=-1).tolist())(scores[n]) for n in rows})
    return engine, calls


def schedule_bounds(costs: dict, tpot_limit_ms: Optional[float] = None) -> list[dict]:
    """Per number of seats s measured: step(s), the run's shortest duration and its output tok/s (module doc), and
    whether step(s) is within `tpot_limit_ms` (None when no limit is given)."""
    requests, input_len, output_len = costs["requests"], costs["input_len"], costs["output_len"]
    prefill_s = requests * input_len * costs["prefill_ms_per_token"][str(requests)] / 1e3
    bounds = []
    for seats, step_ms in sorted(((int(n), ms) for n, ms in costs["decode_step_ms"].items())):
        if seats > requests:
            continue
        duration = prefill_s + math.ceil(requests / seats) * (output_len - 1) * step_ms / 1e3
        bounds.append({"seats": seats, "step_ms": step_ms, "prefill_s": prefill_s, "duration_s": duration,
                       "output_throughput": requests * output_len / duration,
                       "within_tpot": None if tpot_limit_ms is None else step_ms <= tpot_limit_ms})
    return bounds


def best_within(bounds: list[dict]) -> Optional[dict]:
    """The fastest bound whose step is within the TPOT limit, or None if none is."""
    fitting = [b for b in bounds if b["within_tpot"]]
    return max(fitting, key=lambda b: b["output_throughput"]) if fitting else None


def prefill_needed_ms(costs: dict, bound: dict, output_throughput: float) -> Optional[float]:
    """Milliseconds per prompt token the prefill would have to reach for `bound`'s schedule to deliver
    `output_throughput`, with its decode steps as measured; None where the decode steps alone take too long."""
    requests, input_len, output_len = costs["requests"], costs["input_len"], costs["output_len"]
    decode_s = bound["duration_s"] - bound["prefill_s"]
    allowed_s = requests * output_len / output_throughput - decode_s
    return 1e3 * allowed_s / (requests * input_len) if allowed_s > 0 else None


def run_command(args: argparse.Namespace) -> int:
    """`kvlab bench serving-bound`: the C step's costs, the schedule bounds printed, --json written."""
    from kvlab.bench.provenance import provenance
    from kvlab.engine.llm import load_for_engine

    if args.output_len < 2:
        raise KvlabError(f"--output-len is too small: {args.output_len} (at least 2: a prefill and a decode step)")
    try:
        model, tokenizer = load_for_engine(args.model, args.weights, threads=args.threads)
        costs = measure_costs(model, tokenizer, args.requests, args.input_len, args.output_len, args.kv_cache_dtype,
                              repetitions=args.repetitions, seed=args.seed)
    except (OSError, ValueError) as error:
        raise KvlabError(str(error)) from error
    if not costs:
        raise KvlabError(f"{args.model} with --weights {args.weights} has no C paged step to measure")
    prefill = costs["prefill_ms_per_token"]
    print(f"prefill: {prefill[str(args.requests)]:.3f} ms per token with {args.requests} prompts of {args.input_len} "
          f"in one call ({1e3 / prefill[str(args.requests)]:.0f} tok/s), {prefill['1']:.3f} with one")
    for bound in schedule_bounds(costs):
        seats = str(bound["seats"])
        layers, pick = costs["decode_layers_ms"][seats], costs["greedy_pick_ms"][seats]
        print(f"{bound['seats']:>2} seats: step {bound['step_ms']:6.2f} ms (layers {layers:.2f}, LM head "
              f"{bound['step_ms'] - layers:.2f}; greedy pick {pick:.2f} more), run at least {bound['duration_s']:.2f} s, "
              f"at most {bound['output_throughput']:.1f} output tok/s")
    result = {"benchmark": "serving_bound", "model": args.model, "weights": args.weights, **costs,
              "provenance": provenance(args.threads)}
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
