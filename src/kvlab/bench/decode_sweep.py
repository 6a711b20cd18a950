"""Offline prefill and decode throughput against batch size and context: kvlab, transformers, llama.cpp.

Every point (batch B, context L) is B random prompts of L tokens, each continued greedily by
exactly `new_tokens` tokens; prefill is the first forward pass over all B x L prompt tokens,
decode the steps after it. The engines take turns at each point (kvlab, then transformers'
`generate`, then llama.cpp's batched decode), so drift of a shared machine falls on all alike,
and every figure is also a ratio to kvlab's at the same point, from the same run. With
`rounds` > 1 the turns repeat and each engine keeps its fastest prefill and decode (`best_of`):
one round per point let a few seconds' stall of this shared machine pass for an engine's speed. Decode is set
against the bandwidth roofline `kvlab plan` computes (kvlab.plan.roofline.decode_step: the
weights kvlab reads from the GGUF plus each sequence's KV cache, over this machine's measured
bandwidth, kvlab.bench.bandwidth): the same floor for every engine, so a fraction above 1 is
impossible for kvlab and shows where a peer reads fewer bytes. Batch-1 end-to-end decode speed
(prompt included) stays in kvlab.bench.decode_speed, whose engines this module reuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

DEFAULT_BATCHES = (1, 4, 8, 16, 32)
DEFAULT_CONTEXTS = (128, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class Point:
    batch: int
    context: int


def grid(batches: Sequence[int], contexts: Sequence[int], full: bool) -> list[Point]:
    """Every (batch, context) pair when `full`; else the cross: every batch at the shortest context, every
    context at batch 1 (the full grid's large corner is minutes per engine on a small machine)."""
    if full:
        return [Point(b, c) for c in contexts for b in batches]
    shortest = min(contexts)
    points = [Point(b, shortest) for b in batches]
    return points + [Point(1, c) for c in contexts if c != shortest and Point(1, c) not in points]


def _timing(prefill_s: float, decode_s: float, batch: int, context: int, new_tokens: int) -> dict:
    steps = new_tokens - 1  # the first new token comes out of the prefill pass
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps,
            "prefill_tokens_per_s": batch * context / prefill_s,
            "decode_tokens_per_s": batch * steps / decode_s if steps and decode_s > 0 else None}


def kvlab_runner(model, kv_cache_dtype: str = "auto") -> Callable[[list[list[int]], int], dict]:
    from kvlab.nn.generate import cache_for_generation, generate

    def run(prompts: list[list[int]], new_tokens: int) -> dict:
        tokens = torch.tensor(prompts)
        cache = cache_for_generation(model, len(prompts), tokens.shape[1] + new_tokens - 1, kv_cache_dtype)
        stats: dict = {}
        with torch.inference_mode():
            generate(model, tokens, new_tokens, cache=cache, stats=stats)
        out = _timing(stats["prefill_s"], stats["decode_s"], len(prompts), tokens.shape[1], new_tokens)
        out["decode_path"] = "fused C step" if stats.get("paged_step") else "module by module"
        return out

    return run


def transformers_runner(gguf: str, dtype: torch.dtype) -> Callable[[list[list[int]], int], dict]:
    """transformers `generate` on the same GGUF's weights, dequantised to `dtype` (kvlab's HF export of the file,
    which also serves GGUFs transformers' own reader refuses); a logits processor stamps each step."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from transformers.utils import logging as hf_logging

    from kvlab.bench.hf_export import hf_dir_for

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(hf_dir_for(gguf, str(dtype).removeprefix("torch.")),
                                                 dtype=dtype).eval()

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def run(prompts: list[list[int]], new_tokens: int) -> dict:
        ids = torch.tensor(prompts)
        stamp = Stamp()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                           logits_processor=LogitsProcessorList([stamp]))
        return _timing(stamp.times[0] - started, stamp.times[-1] - stamp.times[0], len(prompts), ids.shape[1],
                       new_tokens)

    return run


def llama_cpp_runner(gguf: str, threads: int) -> Optional[Callable[[list[list[int]], int], dict]]:
    from kvlab.bench.llama_cpp_batch import run_llama_cpp

    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None

    def run(prompts: list[list[int]], new_tokens: int) -> dict:
        out = run_llama_cpp(gguf, prompts, new_tokens, threads)
        return _timing(out["prefill_s"], out["elapsed_s"] - out["prefill_s"], len(prompts), len(prompts[0]),
                       new_tokens)

    return run


def roofline_tokens_per_s(config, weight_bytes: int, point: Point, new_tokens: int, bandwidth_gbs: float,
                          kv_cache_dtype: str = "auto", model_dtype: str = "fp32") -> float:
    """The bandwidth floor's decode rate at this point (kvlab.plan: weights + B KV caches per step)."""
    from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
    from kvlab.plan.roofline import decode_step

    spec = config.to_plan_spec()
    context = point.context + new_tokens // 2  # the decode steps' mean context
    kv = kv_bytes_per_sequence(spec, context, cache_formats(kv_cache_dtype, model_dtype=model_dtype))
    floor = decode_step(spec, weight_bytes, kv, point.batch, context, bandwidth_gbs, float("inf")).seconds
    return point.batch / floor


def best_of(runs: list[dict], batch: int, context: int, new_tokens: int) -> dict:
    """One engine's rounds at a point as one figure: the shortest prefill and the shortest decode.

    Another process's burst on a shared machine only ever adds time to a phase, so the fastest
    round is the one it touched least; every round's times stay in `rounds`."""
    best = dict(runs[0])
    best.update(_timing(min(r["prefill_s"] for r in runs), min(r["decode_s"] for r in runs), batch, context,
                        new_tokens))
    best["rounds"] = [{"prefill_s": r["prefill_s"], "decode_s": r["decode_s"]} for r in runs]
    return best


def sweep(engines: dict[str, Callable[[list[list[int]], int], dict]], points: Sequence[Point], new_tokens: int,
          prompts_for: Callable[[Point], list[list[int]]], roofline: Callable[[Point], float],
          progress: Optional[Callable[[], None]] = None, rounds: int = 1) -> list[dict]:
    """At each point every engine in turn, `rounds` times over (the first engine is the ratios'
    denominator); each engine's figure is its best round (`best_of`)."""
    rows = []
    first = next(iter(engines))
    for point in points:
        prompts = prompts_for(point)
        row = {"batch": point.batch, "context": point.context, "new_tokens": new_tokens,
               "roofline_decode_tokens_per_s": roofline(point), "engines": {}}
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(rounds):
            for name, run in engines.items():
                runs[name].append(run(prompts, new_tokens))
                if progress is not None:
                    progress()
        for name, results in runs.items():
            row["engines"][name] = best_of(results, point.batch, point.context, new_tokens)
        ours = row["engines"][first]
        for name, result in row["engines"].items():
            for kind in ("prefill", "decode"):
                mine, theirs = ours[f"{kind}_tokens_per_s"], result[f"{kind}_tokens_per_s"]
                result[f"{kind}_ratio_to_{first}"] = theirs / mine if mine and theirs else None
            rate = result["decode_tokens_per_s"]
            result["decode_roofline_fraction"] = rate / row["roofline_decode_tokens_per_s"] if rate else None
        rows.append(row)
    return rows
