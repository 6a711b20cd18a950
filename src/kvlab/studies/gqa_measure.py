"""Measurements on trained models: cache bytes (plan against tensors), decode speed, samples.

Decode speed is timed the way machine noise hurts least: every variant in one process, the
variants interleaved within each repeat (and the order rotated between repeats), the median
kept. Cache bytes are read from the cache while it generates and compared with the planner's
formula for exactly that model, context and batch.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

from kvlab.cache.base import model_dtype_name
from kvlab.nn.generate import generate
from kvlab.nn.mla import MLA
from kvlab.nn.model import Decoder
from kvlab.plan.capacity import cache_formats, kv_bytes_per_sequence
from kvlab.train.data import CharCorpus
from kvlab.train.progress import progress_bar

Log = Callable[[str], None]


def use_absorbed_decode(model: Decoder) -> Decoder:
    """MLA decodes over the cached latent with W_uk/W_uv absorbed (DeepSeek-V2's inference path)."""
    for module in model.modules():
        if isinstance(module, MLA):
            module.absorb = True
    return model


def plan_kv_bytes(model: Decoder, tokens: int, batch: int) -> int:
    """kvlab.plan's bytes for `batch` sequences of `tokens` tokens, cache in the model's dtype."""
    dtype = model_dtype_name(model.dtype)
    formats = cache_formats("auto", model_dtype=dtype)
    return batch * kv_bytes_per_sequence(model.config.to_plan_spec(), tokens, formats)


def prompt_id(corpus: CharCorpus) -> int:
    return corpus.chars.index("\n") if "\n" in corpus.chars else 0


def timed_generation(model: Decoder, batch: int, new_tokens: int, first_id: int) -> dict:
    """Greedy-generate `new_tokens` for `batch` one-token prompts; time it and weigh the cache."""
    context = 1 + new_tokens
    cache = model.new_cache(batch, context)
    seen = []
    prompt = torch.full((batch, 1), first_id, dtype=torch.long)
    start = time.perf_counter()
    generate(model, prompt, new_tokens, cache=cache, on_token=lambda ids: seen.append(None))
    seconds = time.perf_counter() - start
    measured = cache.nbytes()  # every tensor the cache holds, read after the last step
    return {"batch": batch, "tokens": new_tokens, "seconds": seconds, "tokens_per_s": batch * len(seen) / seconds,
            "context": context, "kv_bytes_measured": measured, "kv_bytes_formula": plan_kv_bytes(model, context, batch)}


def decode_speed(models: dict[str, Decoder], batches, new_tokens: int, repeats: int, first_id: int,
                 log: Optional[Log] = None, progress: bool = True) -> dict:
    """Per variant and batch: every repeat's tokens/s, the median, and the cache bytes checked."""
    names = list(models)
    for model in models.values():
        use_absorbed_decode(model).eval()
        for batch in batches:
            timed_generation(model, batch, min(16, new_tokens), first_id)  # warm-up: allocator, kernels
    runs: dict[str, dict[str, list]] = {name: {str(b): [] for b in batches} for name in names}
    cells = [(r, b, n) for r in range(repeats) for b in batches
             for n in names[r % len(names):] + names[:r % len(names)]]
    bar = progress_bar(len(cells), "decode", enabled=progress)
    for repeat, batch, name in cells:
        result = timed_generation(models[name], batch, new_tokens, first_id)
        result["repeat"] = repeat
        runs[name][str(batch)].append(result)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(variant=name, batch=batch, tok_s=f"{result['tokens_per_s']:,.0f}", refresh=False)
        if log is not None:
            log(f"decode: repeat {repeat} batch {batch} {name}: {result['tokens_per_s']:,.1f} tok/s")
    if bar is not None:
        bar.close()
    out = {}
    for name in names:
        out[name] = {}
        for batch, results in runs[name].items():
            speeds = [r["tokens_per_s"] for r in results]
            out[name][batch] = {
                "tokens_per_s_median": statistics.median(speeds), "tokens_per_s_runs": speeds,
                "kv_bytes_formula": results[0]["kv_bytes_formula"],
                "kv_bytes_measured": max(r["kv_bytes_measured"] for r in results),
                "context": results[0]["context"], "tokens": new_tokens,
            }
    return out


@torch.inference_mode()
def prefill_bytes(model: Decoder, contexts, first_id: int) -> list[dict]:
    """Cache bytes after prefilling one sequence of each context length, plan against tensors."""
    rows = []
    for context in contexts:
        if context > model.config.max_seq_len:
            continue
        cache = model.new_cache(1, context)
        model(torch.full((1, context), first_id, dtype=torch.long), cache, last_only=True)
        rows.append({"context": context, "batch": 1, "kv_bytes_measured": cache.nbytes(),
                     "kv_bytes_formula": plan_kv_bytes(model, context, 1)})
    return rows


def sample_text(model: Decoder, corpus: CharCorpus, chars: int, seed: int = 0, temperature: float = 0.8) -> str:
    """A short sample from a newline prompt, seeded so the report's text is reproducible."""
    generator = torch.Generator().manual_seed(seed)
    ids = generate(model.eval(), [prompt_id(corpus)], chars, temperature=temperature, generator=generator)
    return corpus.decode(ids[0].tolist())
